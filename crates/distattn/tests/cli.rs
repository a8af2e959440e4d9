//! The command line end to end: results on .npy files, and one-line errors for bad input.

use distattn::{DType, HostTensor};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn distattn(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_distattn")).args(args).output().expect("binary runs")
}

fn save(dir: &Path, name: &str, shape: &[usize], seed: u32, dtype: DType) -> PathBuf {
    let n: usize = shape.iter().product();
    // A cheap deterministic spread of values in [-1, 1): enough to exercise the CLI plumbing.
    let vals: Vec<f32> =
        (0..n as u32).map(|i| ((i.wrapping_mul(2654435761) ^ seed) % 2000) as f32 / 1000.0 - 1.0).collect();
    save_values(dir, name, shape, &vals, dtype)
}

/// `vals` as an .npy file of `dtype` (bf16 as its bit patterns in uint16, the documented way).
fn save_values(dir: &Path, name: &str, shape: &[usize], vals: &[f32], dtype: DType) -> PathBuf {
    let path = dir.join(name);
    match dtype {
        DType::F32 => HostTensor::write_npy_f32(&path, shape, vals).unwrap(),
        _ => {
            let t = HostTensor::from_f32(shape.to_vec(), vals, DType::BF16);
            let distattn::HostData::BF16(bits) = t.data else { unreachable!() };
            let mut bytes = Vec::new();
            let header = format!(
                "{{'descr': '<u2', 'fortran_order': False, 'shape': ({}), }}",
                shape.iter().map(|d| format!("{d},")).collect::<String>()
            );
            let pad = 64 - (10 + header.len() + 1) % 64;
            let header = format!("{header}{}\n", " ".repeat(pad % 64));
            bytes.extend_from_slice(b"\x93NUMPY\x01\x00");
            bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
            bytes.extend_from_slice(header.as_bytes());
            for b in bits {
                bytes.extend_from_slice(&b.to_bits().to_le_bytes());
            }
            std::fs::write(&path, bytes).unwrap();
        }
    }
    path
}

/// [`save`] of an f32 tensor, as the path string the CLI takes.
fn saved(dir: &Path, name: &str, shape: &[usize], seed: u32) -> String {
    save(dir, name, shape, seed, DType::F32).to_str().unwrap().to_string()
}

fn one_line_error(out: &Output, needle: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "expected failure, got success; stderr: {err}");
    assert_eq!(err.trim().lines().count(), 1, "one line expected, got: {err}");
    assert!(err.starts_with("error: "), "{err}");
    assert!(err.contains(needle), "'{needle}' not in: {err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn run_writes_outputs_and_gradients() {
    use distattn::{AttnOptions, AttnShape, Mask};
    use distattn_testkit::{cast, lse_err, randn, reference, rel_err, seeded_rng};
    let (mut rng, seed) = seeded_rng("run_writes_outputs_and_gradients");
    let shape = AttnShape::new(1, 37, 37, 4, 2, 32).unwrap();
    let mask = Mask::causal(37, 37).unwrap();
    let (q_dims, kv_dims) = ([1, 37, 4, 32], [1, 37, 2, 32]);
    let (q, k, v, d_o) = (
        randn(&mut rng, shape.q_elems(), 1.0),
        randn(&mut rng, shape.kv_elems(), 1.0),
        randn(&mut rng, shape.kv_elems(), 1.0),
        randn(&mut rng, shape.q_elems(), 1.0),
    );
    let dir = tempfile::tempdir().unwrap();
    let p = |p: &PathBuf| p.to_str().unwrap().to_string();
    let file = |name: &str, dims: &[usize], vals: &[f32], dtype| p(&save_values(dir.path(), name, dims, vals, dtype));
    let read = |name: &str, dims: &[usize]| {
        let t = HostTensor::read_npy(dir.path().join(name)).unwrap();
        assert_eq!(t.shape, dims, "{name}");
        t.to_f32()
    };
    // `run` on q, k, v stored as `dtype` (files tagged `tag`), O into o{tag}.npy, plus `more`.
    let run = |tag: &str, dtype, more: &[&str]| {
        let (qf, kf, vf) = (
            file(&format!("q{tag}.npy"), &q_dims, &q, dtype),
            file(&format!("k{tag}.npy"), &kv_dims, &k, dtype),
            file(&format!("v{tag}.npy"), &kv_dims, &v, dtype),
        );
        let out = p(&dir.path().join(format!("o{tag}.npy")));
        let mut args = vec!["run", "--q", &qf, "--k", &kf, "--v", &vf, "--mask", "causal", "--out", &out];
        args.extend(more);
        let out = distattn(&args);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    };
    let (lse, g, grad_dir) =
        (p(&dir.path().join("lse.npy")), file("g.npy", &q_dims, &d_o, DType::F32), p(&dir.path().to_path_buf()));
    run("", DType::F32, &["--lse", &lse, "--grad-out", &g, "--grad-dir", &grad_dir]);
    // The files hold the f64 reference's numbers, each in its documented layout.
    let opts = AttnOptions::default();
    let rf = reference::forward(&q, &k, &v, &shape, &mask, &opts).unwrap();
    let rg = reference::backward(&q, &k, &v, &d_o, &shape, &mask, &opts).unwrap();
    let errs = [
        ("o", rel_err(&read("o.npy", &q_dims), &rf.o)),
        ("lse", lse_err(&read("lse.npy", &[1, 4, 37]), &rf.lse)),
        ("dq", rel_err(&read("dq.npy", &q_dims), &rg.dq)),
        ("dk", rel_err(&read("dk.npy", &kv_dims), &rg.dk)),
        ("dv", rel_err(&read("dv.npy", &kv_dims), &rg.dv)),
    ];
    for (name, err) in errs {
        assert!(err < 1e-5, "{name}: error {err:.2e} against f64 (DISTATTN_SEED={seed})");
    }
    // bf16 bit-pattern inputs run in bf16: the reference on the same rounded inputs, to bf16 precision.
    run("b", DType::BF16, &[]);
    let (qb, kb, vb) = (cast::<half::bf16>(&q), cast::<half::bf16>(&k), cast::<half::bf16>(&v));
    let rb = reference::forward(&qb, &kb, &vb, &shape, &mask, &opts).unwrap();
    let err = rel_err(&read("ob.npy", &q_dims), &rb.o);
    assert!(err < 1e-2, "bf16 O: error {err:.2e} against f64 (DISTATTN_SEED={seed})");
}

/// The names of the files in `dir`, sorted.
fn file_names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

#[test]
fn output_naming_an_input_or_another_output_is_refused_before_writing() {
    let dir = tempfile::tempdir().unwrap();
    let p = |p: &PathBuf| p.to_str().unwrap().to_string();
    let q = save(dir.path(), "q.npy", &[1, 16, 2, 16], 1, DType::F32);
    let k = saved(dir.path(), "k.npy", &[1, 16, 2, 16], 2);
    let v = saved(dir.path(), "v.npy", &[1, 16, 2, 16], 3);
    let g = save(dir.path(), "g.npy", &[1, 16, 2, 16], 4, DType::F32);
    let (q_bytes, g_bytes) = (std::fs::read(&q).unwrap(), std::fs::read(&g).unwrap());
    let before = file_names(dir.path());
    let o = p(&dir.path().join("o.npy"));
    let (q, g) = (p(&q), p(&g));
    // Through another spelling of the same directory too: paths are compared in canonical form.
    let o_again = format!("{}/./o.npy", dir.path().display());
    one_line_error(
        &distattn(&["run", "--q", &q, "--k", &k, "--v", &v, "--out", &o, "--lse", &o_again]),
        "--out and --lse name the same file",
    );
    one_line_error(
        &distattn(&["run", "--q", &q, "--k", &k, "--v", &v, "--out", &g, "--grad-out", &g]),
        "--grad-out and --out name the same file",
    );
    one_line_error(
        &distattn(&["run", "--q", &q, "--k", &k, "--v", &v, "--out", &o, "--grad-out", &g, "--dq", &q]),
        "--q and --dq name the same file",
    );
    let dq_in_dir = p(&dir.path().join("dq.npy"));
    let grad_dir = p(&dir.path().to_path_buf());
    one_line_error(
        &distattn(&[
            "run",
            "--q",
            &q,
            "--k",
            &k,
            "--v",
            &v,
            "--out",
            &dq_in_dir,
            "--grad-out",
            &g,
            "--grad-dir",
            &grad_dir,
        ]),
        "--out and --grad-dir name the same file",
    );
    assert_eq!(file_names(dir.path()), before, "no output may appear");
    assert_eq!(std::fs::read(&q).unwrap(), q_bytes);
    assert_eq!(std::fs::read(&g).unwrap(), g_bytes);
}

#[test]
#[cfg(target_os = "linux")]
fn unwritable_output_directory_is_refused_before_computing() {
    let dir = tempfile::tempdir().unwrap();
    let q = saved(dir.path(), "q.npy", &[1, 16, 2, 16], 1);
    let k = saved(dir.path(), "k.npy", &[1, 16, 2, 16], 2);
    // /proc takes no new files, even from root (a chmod'ed directory would not stop root).
    let out = distattn(&["run", "--q", &q, "--k", &k, "--v", &k, "--out", "/proc/o.npy"]);
    // One line: the error, and no "forward: ..." line before it.
    one_line_error(&out, "--out /proc/o.npy: cannot create files in /proc");
    let out = distattn(&["run", "--q", &q, "--k", &k, "--v", &k, "--lse", "/no/such/dir/lse.npy"]);
    one_line_error(&out, "directory /no/such/dir not found");
    // A link to a file still to be made is written through; a link into no directory is
    // refused up front, like the path itself would be.
    let ahead = dir.path().join("ahead.npy");
    std::os::unix::fs::symlink("made/o.npy", &ahead).unwrap();
    std::fs::create_dir(dir.path().join("made")).unwrap();
    let out = distattn(&["run", "--q", &q, "--k", &k, "--v", &k, "--out", ahead.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(dir.path().join("made/o.npy").is_file() && ahead.is_symlink());
    let nowhere = dir.path().join("nowhere.npy");
    std::os::unix::fs::symlink("/no/such/dir/o.npy", &nowhere).unwrap();
    let out = distattn(&["run", "--q", &q, "--k", &k, "--v", &k, "--out", nowhere.to_str().unwrap()]);
    one_line_error(&out, "directory /no/such/dir not found");
}

#[test]
fn full_disk_leaves_the_old_output_intact() {
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().unwrap();
    let p = |p: &PathBuf| p.to_str().unwrap().to_string();
    // O is 64 * 4 * 32 f32 = 32 KiB, eight times the limit below.
    let q = saved(dir.path(), "q.npy", &[1, 64, 4, 32], 1);
    let k = saved(dir.path(), "k.npy", &[1, 64, 2, 32], 2);
    let o = dir.path().join("o.npy");
    let old = b"the previous o.npy".to_vec();
    std::fs::write(&o, &old).unwrap();
    let before = file_names(dir.path());
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_distattn"));
    cmd.args(["run", "--q", &q, "--k", &k, "--v", &k, "--out", &p(&o)]);
    const LIMIT_BYTES: libc::rlim_t = 4096;
    // SAFETY: the closure runs in the child between fork and exec, where only async-signal-safe
    // calls are allowed: setrlimit and signal are, and it allocates nothing. Ignoring SIGXFSZ
    // makes a write past the limit fail with EFBIG (as on a full disk) instead of killing the child.
    unsafe {
        cmd.pre_exec(|| {
            let limit = libc::rlimit { rlim_cur: LIMIT_BYTES, rlim_max: LIMIT_BYTES };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &limit) != 0
                || libc::signal(libc::SIGXFSZ, libc::SIG_IGN) == libc::SIG_ERR
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = cmd.output().expect("binary runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "expected failure; stderr: {err}");
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error: ")).collect();
    assert_eq!(errors.len(), 1, "one error line expected: {err}");
    assert!(errors[0].contains("o.npy") && errors[0].contains("too large"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(std::fs::read(&o).unwrap(), old, "the old o.npy must be left as it was");
    assert_eq!(file_names(dir.path()), before, "no temporary file may be left behind");
}

#[test]
fn gradients_without_destination_are_summarized_not_written() {
    let dir = tempfile::tempdir().unwrap();
    let p = |p: &PathBuf| p.to_str().unwrap().to_string();
    let q = saved(dir.path(), "q.npy", &[1, 16, 2, 16], 1);
    let k = saved(dir.path(), "k.npy", &[1, 16, 2, 16], 2);
    let g = saved(dir.path(), "g.npy", &[1, 16, 2, 16], 4);
    let o = p(&dir.path().join("o.npy"));
    // Run in a directory of its own: nothing may appear there (the old default was ./dq.npy).
    let cwd = tempfile::tempdir().unwrap();
    for extra in [&[][..], &["--out", &o][..]] {
        let out = Command::new(env!("CARGO_BIN_EXE_distattn"))
            .args(["run", "--q", &q, "--k", &k, "--v", &k, "--grad-out", &g])
            .args(extra)
            .current_dir(cwd.path())
            .output()
            .expect("binary runs");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(stdout.lines().count(), 1, "{stdout}");
        for word in ["dq: [1, 16, 2, 16] f32, mean", "dk:", "dv:", "--grad-dir"] {
            assert!(stdout.contains(word), "'{word}' not in: {stdout}");
        }
        assert!(file_names(cwd.path()).is_empty(), "{:?}", file_names(cwd.path()));
    }
    assert_eq!(file_names(dir.path()), ["g.npy", "k.npy", "o.npy", "q.npy"], "no dq.npy beside --out");
    one_line_error(&distattn(&["run", "--q", &q, "--k", &k, "--v", &k, "--dq", &o]), "--dq needs --grad-out");
}

#[test]
fn bad_input_is_one_line_error() {
    let dir = tempfile::tempdir().unwrap();
    let p = |p: &PathBuf| p.to_str().unwrap().to_string();
    let q = saved(dir.path(), "q.npy", &[1, 16, 4, 32], 1);
    let k = saved(dir.path(), "k.npy", &[1, 16, 4, 32], 2);
    let v = saved(dir.path(), "v.npy", &[1, 16, 4, 32], 3);
    let k3 = saved(dir.path(), "k3.npy", &[1, 16, 3, 32], 2);
    let kd = saved(dir.path(), "kd.npy", &[1, 16, 4, 16], 2);
    let vb = p(&save(dir.path(), "vb.npy", &[1, 16, 4, 32], 3, DType::BF16));
    one_line_error(&distattn(&["run", "--q", &q, "--k", &kd, "--v", &kd]), "shape mismatch");
    one_line_error(&distattn(&["run", "--q", &q, "--k", &k3, "--v", &k3]), "multiple of key/value heads");
    one_line_error(&distattn(&["run", "--q", &q, "--k", &k, "--v", &vb]), "dtype mismatch");
    one_line_error(&distattn(&["run", "--q", &q, "--k", &k, "--v", &v, "--mask", "diagonal"]), "unknown mask");
    one_line_error(&distattn(&["run", "--q", &q, "--k", &k, "--v", &v, "--mask", "docs:3,4"]), "document lengths");
    one_line_error(
        &distattn(&["run", "--q", &q, "--k", &k, "--v", &dir.path().join("nope.npy").to_string_lossy()]),
        "nope.npy",
    );
    let mut vals = vec![0.5f32; 16 * 4 * 32];
    vals[77] = f32::NAN;
    let qn = dir.path().join("qn.npy");
    HostTensor::write_npy_f32(&qn, &[1, 16, 4, 32], &vals).unwrap();
    one_line_error(
        &distattn(&["run", "--q", &p(&qn), "--k", &k, "--v", &v, "--check-finite"]),
        "non-finite value (NaN or infinity) at q[0, 0, 2, 13]",
    );
}

#[test]
fn usage_errors_name_the_missing_argument() {
    let out = distattn(&["run", "--k", "k.npy", "--v", "v.npy"]);
    one_line_error(&out, "the following required arguments were not provided: --q <Q>");
    assert!(!String::from_utf8_lossy(&out.stderr).contains("Usage"));
}

#[test]
fn inputs_are_read_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let p = |p: &PathBuf| p.to_str().unwrap().to_string();
    let q = save(dir.path(), "q.npy", &[1, 16, 4, 32], 1, DType::BF16);
    let k = p(&save(dir.path(), "k.npy", &[1, 16, 4, 32], 2, DType::BF16));
    let good = std::fs::read(&q).unwrap();
    let mut trailing = good.clone();
    trailing.extend_from_slice(&[0; 6]);
    let qt = dir.path().join("qt.npy");
    std::fs::write(&qt, trailing).unwrap();
    one_line_error(
        &distattn(&["run", "--q", &p(&qt), "--k", &k, "--v", &k]),
        "header says [1, 16, 4, 32] of <u2 = 4096 bytes, file has 4102 bytes after the header",
    );
    std::fs::write(&qt, &good[..good.len() - 2]).unwrap();
    one_line_error(&distattn(&["run", "--q", &p(&qt), "--k", &k, "--v", &k]), "file has 4094 bytes after the header");
    // A header claiming 2^64 elements: an error at once, not a panic or a huge allocation.
    let dict = b"{'descr': '<u2', 'fortran_order': False, 'shape': (4294967296, 4294967296, 1, 1), }\n";
    let mut huge = b"\x93NUMPY\x01\x00".to_vec();
    huge.extend_from_slice(&(dict.len() as u16).to_le_bytes());
    huge.extend_from_slice(dict);
    huge.extend_from_slice(&[0; 16]);
    std::fs::write(&qt, huge).unwrap();
    one_line_error(&distattn(&["run", "--q", &p(&qt), "--k", &k, "--v", &k]), "[4294967296, 4294967296, 1, 1] of <u2");
    let k3 = p(&save(dir.path(), "k3.npy", &[16, 4, 32], 2, DType::BF16));
    one_line_error(
        &distattn(&["run", "--q", &p(&q), "--k", &k3, "--v", &k3]),
        "q, k and v must have the same number of dimensions",
    );
}

#[test]
fn check_finite_sees_the_values_after_the_dtype_cast() {
    let dir = tempfile::tempdir().unwrap();
    let p = |p: &PathBuf| p.to_str().unwrap().to_string();
    let shape = [1, 8, 4, 32];
    let k = saved(dir.path(), "k.npy", &shape, 2);
    // 70000 is finite in f32 but beyond f16's largest value (65504).
    let mut vals = vec![0.5f32; 8 * 4 * 32];
    vals[(5 * 4 + 2) * 32 + 17] = 70000.0;
    let big = dir.path().join("big.npy");
    HostTensor::write_npy_f32(&big, &shape, &vals).unwrap();
    let big = p(&big);
    let [dq, dk, dv] = ["dq.npy", "dk.npy", "dv.npy"].map(|name| p(&dir.path().join(name)));
    let with = |q: &str, grad_out: Option<&str>| {
        let mut all =
            vec!["run", "--q", q, "--k", &k, "--v", &k, "--dtype", "f16", "--check-finite", "--backend", "cpu"];
        if let Some(g) = grad_out {
            all.extend(["--grad-out", g, "--dq", &dq, "--dk", &dk, "--dv", &dv]);
        }
        distattn(&all)
    };
    one_line_error(&with(&big, None), "at q[0, 5, 2, 17]: the file's value 70000 overflows f16");
    // --grad-out is converted to q's dtype (f16 here) and checked with the inputs.
    let out = with(&k, Some(&big));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.trim()
            .lines()
            .last()
            .unwrap()
            .ends_with("at grad-out[0, 5, 2, 17]: the file's value 70000 overflows f16 (converted to q's dtype, f16)"),
        "{err}"
    );
    // Without --dtype the value stays f32, finite.
    let out = distattn(&["run", "--q", &big, "--k", &k, "--v", &k, "--check-finite", "--backend", "cpu"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn help_explains_options() {
    let out = distattn(&["run", "--help"]);
    let text = String::from_utf8_lossy(&out.stdout);
    for word in ["--mask", "--grad-out", "--grad-dir", "--check-finite", "--lse", "window:L,R", "docs-causal"] {
        assert!(text.contains(word), "run --help lacks {word}");
    }
    let out = distattn(&["bench", "--help"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("--json"));
}

#[test]
fn run_on_ranks_matches_single_call_and_failed_rank_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let p = |p: &PathBuf| p.to_str().unwrap().to_string();
    let q = saved(dir.path(), "q.npy", &[1, 45, 4, 16], 1);
    let k = saved(dir.path(), "k.npy", &[1, 45, 2, 16], 2);
    let v = saved(dir.path(), "v.npy", &[1, 45, 2, 16], 3);
    let single = dir.path().join("o1.npy");
    let out = distattn(&["run", "--q", &q, "--k", &k, "--v", &v, "--mask", "causal", "--out", &p(&single)]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let want = HostTensor::read_npy(&single).unwrap().to_f32();
    for strategy in ["ring", "zigzag", "balanced", "ulysses", "hybrid", "allgather", "dispatch"] {
        let o = dir.path().join(format!("o-{strategy}.npy"));
        let out = distattn(&[
            "run",
            "--q",
            &q,
            "--k",
            &k,
            "--v",
            &v,
            "--mask",
            "causal",
            "--world",
            "2",
            "--strategy",
            strategy,
            "--out",
            &p(&o),
        ]);
        assert!(out.status.success(), "{strategy}: {}", String::from_utf8_lossy(&out.stderr));
        let got = HostTensor::read_npy(&o).unwrap().to_f32();
        let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(err < 1e-5, "{strategy}: max abs diff {err}");
    }
    let started = std::time::Instant::now();
    let out =
        distattn(&["run", "--q", &q, "--k", &k, "--v", &v, "--world", "4", "--strategy", "ring", "--fail-rank", "3"]);
    one_line_error(&out, "rank 3 failed");
    assert!(started.elapsed().as_secs() < 10);
    // A single-step plan fails too, and a rank that stops making progress is given up on after
    // --timeout.
    for (strategy, kind, says) in [
        ("allgather", "error", "rank 1 failed"),
        ("dispatch", "error", "rank 1 failed"),
        ("ring", "hang", "rank 1 failed"),
    ] {
        let started = std::time::Instant::now();
        let out = distattn(&[
            "run",
            "--q",
            &q,
            "--k",
            &k,
            "--v",
            &v,
            "--world",
            "2",
            "--strategy",
            strategy,
            "--fail-rank",
            "1",
            "--fail-kind",
            kind,
            "--timeout",
            "1",
        ]);
        one_line_error(&out, says);
        assert!(started.elapsed().as_secs() < 10, "{strategy} {kind}");
    }
    one_line_error(
        &distattn(&["run", "--q", &q, "--k", &k, "--v", &v, "--world", "3", "--strategy", "ulysses"]),
        "divisible by the world size 3",
    );
}

#[test]
fn plan_json_summary() {
    let plan = |strategy: &str, mask: &str| -> serde_json::Value {
        let out = distattn(&[
            "plan",
            "--strategy",
            strategy,
            "--world",
            "8",
            "--seq",
            "131072",
            "--mask",
            mask,
            "--heads",
            "32",
            "--kv-heads",
            "8",
            "--json",
        ]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let ring = plan("ring", "causal");
    for key in ["imbalance", "bytes_moved", "flops", "peak_bytes_per_rank"] {
        assert!(ring[key].is_number(), "{key} missing: {ring}");
    }
    let imbalance = |v: &serde_json::Value| v["imbalance"].as_f64().unwrap();
    assert!((imbalance(&ring) - 1.875).abs() < 0.05, "ring {}", imbalance(&ring));
    assert!(imbalance(&plan("zigzag", "causal")) <= 1.05);
    assert!(imbalance(&plan("balanced", "causal")) <= 1.05);
    let docs = "docs-random-causal:1";
    let dispatch = plan("dispatch", docs);
    assert!(imbalance(&dispatch) <= 1.10);
    for ring_like in ["ring", "zigzag", "hybrid"] {
        assert!(dispatch["bytes_moved"].as_u64() < plan(ring_like, docs)["bytes_moved"].as_u64(), "{ring_like}");
    }
}

#[test]
fn launch_sets_rank_environment_and_names_a_failed_rank() {
    let out = distattn(&[
        "launch",
        "--nproc",
        "3",
        "--",
        "sh",
        "-c",
        "test \"$WORLD_SIZE\" = 3 && test \"$LOCAL_WORLD_SIZE\" = 3 && test -n \"$MASTER_PORT\" && test \"$LOCAL_RANK\" = \"$RANK\"",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let started = std::time::Instant::now();
    let out = distattn(&[
        "launch",
        "--nproc",
        "4",
        "--timeout",
        "1",
        "--",
        "sh",
        "-c",
        "if [ \"$RANK\" = 2 ]; then exit 7; fi; sleep 30",
    ]);
    assert!(started.elapsed().as_secs() < 15, "the launcher stops the other ranks after its timeout");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("rank 2 failed"), "{err}");
}

#[test]
fn bench_gpus_options_are_checked_before_any_work() {
    let out = distattn(&["bench", "--gpus", "0"]);
    one_line_error(&out, "--gpus must be at least 1");
    let out = distattn(&["bench", "--gpus", "2", "--world", "2"]);
    one_line_error(&out, "pass one of them");
    let out = distattn(&["bench", "--gpus", "2", "--backend", "cpu"]);
    one_line_error(&out, "drop --backend cpu");
    let out = distattn(&["bench", "--timelines", "t.json"]);
    one_line_error(&out, "add --gpus N");
    // More GPUs than this machine has: a clear error, not a hang or a panic.
    let out = distattn(&["bench", "--gpus", "4096"]);
    one_line_error(&out, "--gpus 4096 needs 4096 CUDA GPUs");
}

#[test]
fn timeline_tables_and_charts_recorded_runs() {
    let dir = tempfile::tempdir().unwrap();
    // Two ranks, forward then backward. Rank 0's forward moves 2 ms, half of it under compute;
    // its backward step 0 has two transfers 6 ms apart, all under compute.
    let file = dir.path().join("timelines.json");
    let step = |step, compute: [f64; 2], transfers: &[[f64; 2]]| {
        serde_json::json!({"step": step, "compute": compute, "transfers": transfers,
        "comm": transfers.first().map(|t| [t[0], transfers.last().unwrap()[1]])})
    };
    let tl = |rank, total_ms, steps: Vec<serde_json::Value>| serde_json::json!({"rank": rank, "total_ms": total_ms, "steps": steps});
    let runs = serde_json::json!([{"strategy": "zigzag", "seq": 4096, "pass": "fwd+bwd", "mask": "causal", "ranks": [
        tl(0, 4.0, vec![step(0, [1.0, 2.0], &[[0.0, 2.0]]), step(1, [2.0, 4.0], &[])]),
        tl(0, 9.0, vec![step(0, [0.0, 9.0], &[[1.0, 2.0], [8.0, 8.5]])]),
        tl(1, 4.0, vec![step(0, [0.0, 2.0], &[[0.0, 1.0]]), step(1, [2.0, 4.0], &[])]),
        tl(1, 9.0, vec![step(0, [0.0, 9.0], &[])]),
    ]}]);
    std::fs::write(&file, runs.to_string()).unwrap();
    let svg = dir.path().join("charts");
    let out = distattn(&["timeline", file.to_str().unwrap(), "--svg", svg.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<Vec<&str>> =
        stdout.lines().skip(1).filter(|l| l.starts_with("zigzag")).map(|l| l.split_whitespace().collect()).collect();
    // strategy mask seq pass phase rank total compute transfer hidden exposed
    let cols: Vec<(&str, &str, &str, &str, &str)> = rows.iter().map(|r| (r[4], r[5], r[8], r[9], r[10])).collect();
    assert_eq!(
        cols,
        [
            ("forward", "0", "2.000", "50%", "1.000"),
            ("forward", "1", "1.000", "100%", "0.000"),
            ("backward", "0", "1.500", "100%", "0.000"),
            ("backward", "1", "0.000", "100%", "0.000")
        ],
        "{stdout}"
    );
    let chart = std::fs::read_to_string(svg.join("zigzag-causal-4096-fwd_bwd.svg")).unwrap();
    for label in [
        "forward: 67% of transfer time hidden",
        "backward: 100% of transfer time hidden",
        "rank 1 transfer",
        "rank 0 compute",
    ] {
        assert!(chart.contains(label), "{label} not in the chart");
    }
    // One bar per compute span and per transfer: 6 compute, 4 transfer; and a legend swatch
    // per kind and shade.
    let bars =
        |colours: &[&str]| colours.iter().map(|c| chart.matches(&format!("fill=\"#{c}\"")).count()).sum::<usize>();
    assert_eq!((bars(&["1F77B4", "78AAD7"]), bars(&["E67814", "F5B46E"])), (6 + 2, 4 + 2));
    for label in ["compute, even steps", "transfer, odd steps"] {
        assert!(chart.contains(label), "the legend lacks '{label}'");
    }
    // No bar reaches the right edge of the 1000-pixel chart.
    let right_ends =
        chart.split("<rect").skip(1).filter(|r| r.contains("fill=\"#1F77B4\"") || r.contains("fill=\"#E67814\""));
    let attr = |r: &str, name: &str| -> f64 {
        let v = r.split(&format!(" {name}=\"")).nth(1).unwrap();
        v[..v.find('"').unwrap()].parse().unwrap()
    };
    let right = right_ends.map(|r| attr(r, "x") + attr(r, "width")).fold(0.0, f64::max);
    assert!(right < 960.0, "a bar ends at x = {right}");
    // Two runs the name does not tell apart (say two head dims): two charts, not one replaced.
    let twice = dir.path().join("twice.json");
    std::fs::write(&twice, serde_json::json!([runs[0], runs[0]]).to_string()).unwrap();
    let svg2 = dir.path().join("charts2");
    assert!(distattn(&["timeline", twice.to_str().unwrap(), "--svg", svg2.to_str().unwrap()]).status.success());
    for name in ["zigzag-causal-4096-fwd_bwd.svg", "zigzag-causal-4096-fwd_bwd-2.svg"] {
        assert!(svg2.join(name).exists(), "{name} not drawn");
    }

    one_line_error(&distattn(&["timeline", "/no/such/file.json"]), "reading /no/such/file.json");
    std::fs::write(dir.path().join("bad.json"), "{\"rows\": []}").unwrap();
    one_line_error(&distattn(&["timeline", dir.path().join("bad.json").to_str().unwrap()]), "is not a timelines file");
    one_line_error(&distattn(&["timeline", file.to_str().unwrap(), "--strategy", "ring"]), "no run in");
}

const SMALL_BENCH: [&str; 11] =
    ["bench", "--seqs", "128,256", "--mask", "causal", "--head-dims", "32", "--dtypes", "f32", "--repeats", "1"];

#[test]
fn bench_json_to_stdout_is_json_alone_and_the_table_goes_to_stderr() {
    let out = distattn(&[&SMALL_BENCH[..], &["--json", "-"]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("standard output is one JSON document");
    assert_eq!(report["rows"].as_array().unwrap().len(), 4, "2 configurations x fwd, bwd");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("fwd GFLOP/s") && err.contains("causal"), "the table is on standard error: {err}");
    // What a user pipes it into.
    if let Ok(mut child) = Command::new("python3")
        .args(["-m", "json.tool"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
    {
        use std::io::Write;
        child.stdin.take().unwrap().write_all(&out.stdout).unwrap();
        assert!(child.wait().unwrap().success(), "python -m json.tool rejects the output");
    }
}

#[test]
fn redirected_bench_prints_each_row_as_it_finishes() {
    // `distattn bench > log 2>&1`: no terminal, so plain progress lines, and each
    // configuration's row lands before the next configuration starts.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("log");
    let log = std::fs::File::create(&path).unwrap();
    let status = Command::new(env!("CARGO_BIN_EXE_distattn"))
        .args(SMALL_BENCH)
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .status()
        .unwrap();
    assert!(status.success());
    let text = std::fs::read_to_string(&path).unwrap();
    let at = |needle: &str| text.find(needle).unwrap_or_else(|| panic!("'{needle}' not in:\n{text}"));
    let first_row = at("\ncpu     single       f32   causal                    128");
    assert!(at("[1/2") < first_row && first_row < at("[2/2"), "{text}");
    assert!(!text.contains("TF/s") && !text.contains("per-GPU eff"), "CPU units, no empty efficiency column: {text}");
}

#[test]
fn bench_on_ranks_says_when_ranks_share_cores() {
    let world = std::thread::available_parallelism().map_or(1, |n| n.get()) + 1;
    let world = world.to_string();
    let out = distattn(&[&SMALL_BENCH[..], &["--world", &world, "--strategies", "ring", "--forward-only"]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains(&format!("note: {world} ranks share")));
    assert!(String::from_utf8_lossy(&out.stdout).contains("per-rank eff"));
}

#[test]
fn plan_help_lists_planning_options_only() {
    let help = String::from_utf8(distattn(&["plan", "--help"]).stdout).unwrap();
    for planning in ["--world", "--strategy", "--ulysses-degree", "--ring-backward", "--seq", "--mask"] {
        assert!(help.contains(planning), "plan --help lacks {planning}");
    }
    for run_time in ["--timeout", "--fail-rank", "--fail-kind", "--backend", "local GPUs", "in-process"] {
        assert!(!help.contains(run_time), "plan --help shows the run-time '{run_time}':\n{help}");
    }
    // --gpus still names the rank count, as it did.
    let out = distattn(&["plan", "--seq", "512", "--gpus", "2", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // The testing aid is not advertised to users of run either.
    let run_help = String::from_utf8(distattn(&["run", "--help"]).stdout).unwrap();
    assert!(!run_help.contains("--fail-rank") && run_help.contains("--timeout"));
}

#[test]
fn plan_table_reads_in_a_terminal() {
    let out = distattn(&["plan", "--seq", "131072", "--world", "8", "--heads", "32", "--kv-heads", "8"]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("8 ranks, 8 steps") && text.contains("FLOPs per rank, min-max"), "{text}");
    let rate = format!(" ms at {:.0} TFLOP/s", distattn::plan::Rates::default().flops_per_s / 1e12);
    assert!(text.contains("estimate: ") && text.contains(&rate), "{text}");
    assert!(text.contains("zigzag 0: own kv") && text.contains("zigzag 1: kv of rank r-1"), "{text}");
    assert!(!text.contains("FLOP/B") && !text.contains("-0"), "{text}");
    assert!(text.lines().all(|l| l.len() <= 100), "lines over 100 columns:\n{text}");
    let one = String::from_utf8(distattn(&["plan", "--seq", "512"]).stdout).unwrap();
    assert!(one.contains("1 rank, 1 step,"), "{one}");
}

#[test]
fn plan_choose_estimates_every_candidate_and_names_autos_pick() {
    let args = ["plan", "--seq", "32768", "--world", "4", "--heads", "8", "--choose"];
    let docs = distattn(&[&args[..], &["--kv-heads", "8", "--mask", "docs-random-causal:1"]].concat());
    let text = String::from_utf8(docs.stdout).unwrap();
    assert!(docs.status.success() && text.contains("auto takes dispatch"), "{text}");
    let picked: Vec<&str> = text.lines().filter(|l| l.ends_with("<- auto")).collect();
    assert!(picked.len() == 1 && picked[0].starts_with("dispatch"), "{text}");
    // 2 KV heads do not split over 4 ranks: Ulysses says so, the others are estimated.
    let few = distattn(&[&args[..], &["--kv-heads", "2"]].concat());
    let text = String::from_utf8(few.stdout).unwrap();
    assert!(text.contains("ulysses    cannot plan this problem") && text.contains("auto takes "), "{text}");
    assert_eq!(text.lines().filter(|l| l.ends_with("<- auto")).count(), 1, "{text}");
    let refused = distattn(&[&args[..], &["--json"]].concat());
    assert!(!refused.status.success());
}

#[test]
fn launch_help_example_runs_with_an_installed_distattn() {
    let help = String::from_utf8(distattn(&["launch", "--help"]).stdout).unwrap();
    assert!(!help.contains("distattn-multigpu-bench"), "{help}");
    let example = help.lines().find_map(|l| l.strip_prefix("Example: ")).expect("an example line");
    let script = example.strip_prefix("distattn launch --nproc 2 -- sh -c ").expect(example).trim_matches('\'');
    let out = distattn(&["launch", "--nproc", "2", "--", "sh", "-c", script]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("rank 0 of 2") && text.contains("rank 1 of 2"), "{text}");
}

#[test]
fn plan_serve_picks_the_strategy_by_traffic() {
    let serve = |requests: &str, extra: &[&str]| -> serde_json::Value {
        let mut args = vec!["plan", "--serve", requests, "--world", "4", "--kv-heads", "8", "--json"];
        args.extend_from_slice(extra);
        let out = distattn(&args);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    // Decode onto long caches: the queries travel, a few hundred kB in all.
    let decode = serve("1000000+1,4000+1@1,200000+1", &[]);
    assert_eq!(decode["strategy"], "pass-q");
    assert_eq!(decode["layout"], "placed");
    assert!(decode["bytes_moved"].as_u64().unwrap() < 1 << 20, "{decode}");
    // A fresh prompt spread like its cache: the keys travel.
    let prefill = serve("0+16384", &["--prefill", "--placement", "contiguous"]);
    assert_eq!(prefill["strategy"], "ring");
    one_line_error(&distattn(&["plan", "--serve", "12", "--world", "2"]), "CACHED+NEW");
    one_line_error(&distattn(&["plan", "--serve", "1+1@5", "--world", "2"]), "rank");
}

#[test]
fn two_nodes_of_two_ranks_on_one_host_get_one_world() {
    // One launcher per "node", as on two hosts; each rank records what it was told.
    let dir = tempfile::tempdir().unwrap();
    let script = "echo \"$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK $MASTER_ADDR:$MASTER_PORT\" > \"$OUT/rank.$RANK\"";
    let node = |rank: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_distattn"))
            .args(["launch", "--nproc", "2", "--nnodes", "2", "--node-rank", rank, "--master-port", "29611"])
            .args(["--", "sh", "-c", script])
            .env("OUT", dir.path())
            .spawn()
            .unwrap()
    };
    let (mut a, mut b) = (node("0"), node("1"));
    assert!(a.wait().unwrap().success() && b.wait().unwrap().success());
    for rank in 0..4 {
        let got = std::fs::read_to_string(dir.path().join(format!("rank.{rank}"))).unwrap();
        let want = format!("{rank} 4 {} 2 {} 127.0.0.1:29611", rank % 2, rank / 2);
        assert_eq!(got.trim(), want);
    }
    one_line_error(
        &distattn(&["launch", "--nproc", "2", "--nnodes", "2", "--node-rank", "2", "--", "true"]),
        "node-rank",
    );
}

#[test]
fn bench_decode_over_a_spread_cache_reports_both_and_checks_its_options() {
    let base = ["bench", "--decode", "--seqs", "200", "--head-dims", "32", "--dtypes", "f32", "--repeats", "1"];
    let out =
        distattn(&[&base[..], &["--world", "2", "--batch", "3", "--placement", "pages:16", "--json", "-"]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = report["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{report}");
    assert_eq!((rows[0]["strategy"].as_str(), rows[0]["ranks"].as_u64()), (Some("single"), Some(1)));
    assert_eq!((rows[1]["strategy"].as_str(), rows[1]["ranks"].as_u64()), (Some("pass-q"), Some(2)));
    assert_eq!(rows[1]["placement"], "pages:16");
    assert!(rows[1]["scaling_eff"].as_f64().unwrap() > 0.0, "{report}");
    assert!(report["check"].as_str().unwrap().contains("spread over 2 CPU ranks"), "{report}");
    one_line_error(&distattn(&[&base[..], &["--world", "2", "--placement", "stripes"]].concat()), "placement");
    one_line_error(&distattn(&[&base[..], &["--gpus", "4096"]].concat()), "--gpus 4096 needs 4096 CUDA GPUs");
    one_line_error(&distattn(&[&base[..], &["--gpus", "2", "--world", "2"]].concat()), "pass one of them");
    one_line_error(&distattn(&["bench", "--decode", "--seqs", "2", "--q-rows", "4"]), "--q-rows");
}

#[test]
fn bench_cached_prefill_times_both_rings_and_names_the_planners_pick() {
    // A cache long enough that moving it (ring) costs more than the second transfer group of
    // pass-q (queries out, partial results back).
    let base =
        ["bench", "--cached-prefill", "--seqs", "16384", "--heads", "8", "--kv-heads", "8", "--head-dims", "128"];
    let out = distattn(
        &[
            &base[..],
            &["--new-tokens", "1,16", "--world", "2", "--placement", "pages:16", "--repeats", "1", "--json", "-"],
        ]
        .concat(),
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = report["rows"].as_array().unwrap();
    let got: Vec<(&str, u64)> =
        rows.iter().map(|r| (r["strategy"].as_str().unwrap(), r["new"].as_u64().unwrap())).collect();
    assert_eq!(
        got,
        [("single", 1), ("pass-q", 1), ("ring", 1), ("single", 16), ("pass-q", 16), ("ring", 16)],
        "{report}"
    );
    for step in rows.chunks(3) {
        assert_eq!(step.iter().filter(|r| r["picked"] == true).count(), 1, "{report}");
        assert!(step[1]["bytes_moved"].as_u64().unwrap() > 0 && step[2]["scaling_eff"].as_f64().unwrap() > 0.0);
    }
    // One new token: the query is far smaller than the keys, so pass-q moves less and is picked.
    assert_eq!(rows[1]["picked"], true, "{report}");
    one_line_error(&distattn(&[&base[..], &["--new-tokens", "4"]].concat()), "--gpus N or --world N");
    one_line_error(&distattn(&[&base[..], &["--new-tokens", "0", "--world", "2"]].concat()), "--new-tokens");
    one_line_error(&distattn(&["bench", "--cached-prefill", "--world", "2"]), "--new-tokens");
    one_line_error(&distattn(&["bench", "--seqs", "64", "--placement", "zigzag"]), "--decode or --cached-prefill");
}

#[test]
fn out_of_range_durations_and_report_paths_fail_before_any_work() {
    // Durations past a year overflowed a deadline: a panic that left launched ranks running.
    let out = distattn(&["launch", "--nproc", "1", "--grace", "18446744073709551615", "--", "true"]);
    one_line_error(&out, "--grace");
    one_line_error(&distattn(&["run", "--timeout", "18446744073709551615"]), "--timeout");
    // No wait at all fails every healthy run on several ranks; no time at all, every launch.
    one_line_error(&distattn(&["run", "--timeout", "0"]), "--timeout");
    one_line_error(&distattn(&["launch", "--nproc", "1", "--max-time", "0", "--", "true"]), "--max-time");
    // A page of no tokens divided by zero.
    one_line_error(&distattn(&["bench", "--decode", "--page-size", "0"]), "--page-size");
    // A report path that cannot be written fails before the benchmark, not after it.
    let t0 = std::time::Instant::now();
    let out = distattn(&["bench", "--backend", "cpu", "--json", "/no/such/dir/report.json"]);
    one_line_error(&out, "/no/such/dir");
    assert!(t0.elapsed() < std::time::Duration::from_secs(5), "the benchmark ran first");
}

#[test]
fn a_closed_output_pipe_ends_the_run_quietly() {
    use std::process::Stdio;
    // Megabytes of plan into a pipe whose reader has gone (as `| head` does).
    let mut child = Command::new(env!("CARGO_BIN_EXE_distattn"))
        .args(["plan", "--seq", "100000", "--world", "64", "--strategy", "ring", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(141), "{err}");
    assert!(err.is_empty(), "{err}");
}

#[test]
fn launch_refuses_ports_its_ranks_would() {
    // The ranks' NCCL bootstrap listens on the next port: 0 and 65535 fail there, so here.
    for port in ["0", "65535"] {
        let out = distattn(&["launch", "--nproc", "2", "--master-port", port, "--", "true"]);
        one_line_error(&out, "--master-port");
    }
}

#[test]
fn a_serving_plan_refuses_options_it_would_ignore() {
    // A serving step is a batch-1 forward with its own mask and strategy choice.
    for (option, value) in
        [("--backward", None), ("--mask", Some("full")), ("--strategy", Some("ring")), ("--batch", Some("2"))]
    {
        let mut args = vec!["plan", "--serve", "4+1", "--world", "2", option];
        args.extend(value);
        one_line_error(&distattn(&args), option);
    }
}
