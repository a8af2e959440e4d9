//! The README's library example is `examples/quickstart.rs`, which cargo compiles with the
//! tests: this checks that the README shows that file's code, so the two cannot drift apart.

#[test]
fn readme_shows_the_compiled_example() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("../../README.md")).expect("README.md");
    let example = std::fs::read_to_string(root.join("examples/quickstart.rs")).expect("the example");
    let shown = readme
        .split("```rust\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("a ```rust block in the README");
    // The example without its file comment (the README says where the file is).
    let code: String =
        example.lines().skip_while(|l| l.starts_with("//!") || l.is_empty()).map(|l| format!("{l}\n")).collect();
    assert_eq!(shown, code, "the README's ```rust block must be examples/quickstart.rs after its //! lines");
}
