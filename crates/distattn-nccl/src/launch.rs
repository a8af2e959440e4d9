//! One process per GPU: the environment a launcher sets for each rank, read the way the usual
//! launchers write it, so a run on several hosts is one command per host:
//!
//! * torchrun (and `distattn launch`): `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
//!   `MASTER_ADDR`, `MASTER_PORT`;
//! * Slurm (`srun`): `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_NTASKS_PER_NODE`
//!   (set with `--ntasks-per-node`) or else `SLURM_TASKS_PER_NODE` (`"4(x2)"`: every run; a
//!   node count only where every node has as many tasks), with `MASTER_ADDR` and `MASTER_PORT`
//!   exported by the batch script;
//! * `NCCL_COMM_ID=host:port`, NCCL's own bootstrap address, taken as given where set.
//!
//! Without `NCCL_COMM_ID`, rank 0 opens NCCL's bootstrap root at `MASTER_ADDR` and the port
//! after `MASTER_PORT`: under torchrun the agent's store already listens on `MASTER_PORT`
//! itself. No transport of our own.

use distattn_core::{Error, Result};

/// What one rank of a multi-process run reads from its environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    pub rank: usize,
    pub world: usize,
    /// GPU ordinal of this rank on its host.
    pub local_rank: usize,
    /// Ranks on this host, where the launcher says (the node structure: `world / local_world`
    /// hosts).
    pub local_world: Option<usize>,
    /// `host:port` of NCCL's bootstrap root.
    pub comm_id: String,
}

fn bad(m: impl Into<String>) -> Error {
    Error::invalid("launcher environment", m)
}

fn parse_num(name: &str, v: &str) -> Result<usize> {
    v.trim().parse().map_err(|_| bad(format!("{name}={v:?} is not a non-negative integer")))
}

/// Checks a `host:port` address (IPv4, a host name, or `[IPv6]:port`).
pub fn check_comm_id(s: &str) -> Result<()> {
    let (host, port) = s.rsplit_once(':').ok_or_else(|| bad(format!("NCCL_COMM_ID={s:?} is not host:port")))?;
    if host.is_empty() {
        return Err(bad(format!("NCCL_COMM_ID={s:?} has no host")));
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(()),
        _ => Err(bad(format!("NCCL_COMM_ID={s:?}: bad port"))),
    }
}

/// The names one launcher gives rank, world size, local rank and ranks per host (and, for
/// Slurm, the list of tasks per node it always sets: `local_world_list`).
struct Names {
    rank: &'static str,
    world: &'static str,
    local_rank: &'static str,
    local_world: &'static str,
    local_world_list: Option<&'static str>,
}

const TORCHRUN: Names = Names {
    rank: "RANK",
    world: "WORLD_SIZE",
    local_rank: "LOCAL_RANK",
    local_world: "LOCAL_WORLD_SIZE",
    local_world_list: None,
};
const SLURM: Names = Names {
    rank: "SLURM_PROCID",
    world: "SLURM_NTASKS",
    local_rank: "SLURM_LOCALID",
    local_world: "SLURM_NTASKS_PER_NODE",
    local_world_list: Some("SLURM_TASKS_PER_NODE"),
};

/// Ranks on each host under `names`' launcher, if it says: its count (Slurm's
/// `SLURM_NTASKS_PER_NODE` is set only with `--ntasks-per-node`), else, for Slurm, the tasks
/// per node it always lists where every node has as many ([`uniform_tasks_per_node`]).
fn local_world_of(names: &Names, get: &impl Fn(&str) -> Option<String>) -> Result<Option<usize>> {
    match get(names.local_world) {
        Some(v) => Ok(Some(parse_num(names.local_world, &v)?)),
        None => Ok(names.local_world_list.and_then(get).and_then(|v| uniform_tasks_per_node(&v))),
    }
}

/// The tasks on every node of a Slurm list such as "4(x2)" or "4,4" (groups of a count and
/// an optional "(xREPEATS)"), or `None` where the nodes' counts differ ("2(x3),1") or the list
/// does not parse: then the run has no uniform node structure to plan by.
pub fn uniform_tasks_per_node(list: &str) -> Option<usize> {
    let count_of = |group: &str| -> Option<usize> {
        let (n, repeat) = group.trim().split_once('(').unwrap_or((group.trim(), "x1)"));
        repeat.strip_prefix('x')?.strip_suffix(')')?.parse::<usize>().ok()?;
        n.parse().ok().filter(|&n| n > 0)
    };
    let mut counts = list.split(',').map(count_of);
    let first = counts.next()??;
    counts.all(|n| n == Some(first)).then_some(first)
}

/// Ranks per host as the launcher's variables say, read through `get`: torchrun's
/// `LOCAL_WORLD_SIZE`, else Slurm's (`SLURM_NTASKS_PER_NODE`, or its uniform
/// `SLURM_TASKS_PER_NODE`); `None` where none says (a process group started without a
/// launcher). For code that joins its group otherwise (the Python package, through
/// torch.distributed) and still plans by node.
pub fn ranks_per_node(get: impl Fn(&str) -> Option<String>) -> Result<Option<usize>> {
    match local_world_of(&TORCHRUN, &get)? {
        Some(n) => Ok(Some(n)),
        None => local_world_of(&SLURM, &get),
    }
    .and_then(|n| match n {
        Some(0) => Err(bad("0 ranks per node")),
        n => Ok(n),
    })
}

impl LaunchEnv {
    /// Reads the variables through `get`: torchrun's names first, else Slurm's. `Ok(None)` when
    /// neither `RANK` nor `SLURM_PROCID` is set (not launched).
    pub fn parse(get: impl Fn(&str) -> Option<String>) -> Result<Option<LaunchEnv>> {
        let names = if get(TORCHRUN.rank).is_some() {
            TORCHRUN
        } else if get(SLURM.rank).is_some() {
            SLURM
        } else {
            return Ok(None);
        };
        let num = |name: &'static str| get(name).map(|v| parse_num(name, &v)).transpose();
        let rank = num(names.rank)?.ok_or_else(|| bad(format!("{} is not set", names.rank)))?;
        let world =
            num(names.world)?.ok_or_else(|| bad(format!("{} is set but {} is not", names.rank, names.world)))?;
        if world == 0 || rank >= world {
            return Err(bad(format!("{}={rank} outside {}={world}", names.rank, names.world)));
        }
        let local_rank = num(names.local_rank)?.unwrap_or(rank);
        let local_world = local_world_of(&names, &get)?;
        if let Some(lw) = local_world {
            if lw == 0 || local_rank >= lw || world % lw != 0 {
                return Err(bad(format!(
                    "{}={local_rank} with {}={lw} and {}={world}: not a whole number of equal hosts",
                    names.local_rank, names.local_world, names.world
                )));
            }
        }
        let comm_id = match (get("NCCL_COMM_ID"), get("MASTER_ADDR"), get("MASTER_PORT")) {
            (Some(id), _, _) => id,
            (None, Some(a), Some(p)) => {
                let port = p.trim().parse::<u16>().ok().filter(|&p| p > 0 && p < u16::MAX);
                let port = port.ok_or_else(|| bad(format!("MASTER_PORT={p:?} is not a port below 65535")))?;
                format!("{a}:{}", port + 1)
            }
            _ => return Err(bad("NCCL_COMM_ID (host:port) or MASTER_ADDR and MASTER_PORT must be set")),
        };
        check_comm_id(&comm_id)?;
        Ok(Some(LaunchEnv { rank, world, local_rank, local_world, comm_id }))
    }

    /// Reads the process environment.
    pub fn from_env() -> Result<Option<LaunchEnv>> {
        Self::parse(|k| std::env::var(k).ok())
    }

    /// The hosts of the run and this rank's host, where the launcher gave ranks per host.
    pub fn node(&self) -> Option<(usize, usize)> {
        self.local_world.map(|lw| (self.world / lw, self.rank / lw))
    }

    /// What a launcher sets for rank `local_rank` of the `local_world` ranks of host
    /// `node_rank`, whose host 0 is `master_addr`: torchrun's variables, so torch programs
    /// and distattn's own ranks both read them (NCCL_COMM_ID is left unset: it would also steer
    /// a torch program's own NCCL groups to one bootstrap address).
    pub fn for_rank(
        node_rank: usize,
        local_rank: usize,
        local_world: usize,
        nodes: usize,
        master_addr: &str,
        master_port: u16,
    ) -> Vec<(String, String)> {
        vec![
            ("RANK".into(), (node_rank * local_world + local_rank).to_string()),
            ("WORLD_SIZE".into(), (nodes * local_world).to_string()),
            ("LOCAL_RANK".into(), local_rank.to_string()),
            ("LOCAL_WORLD_SIZE".into(), local_world.to_string()),
            ("GROUP_RANK".into(), node_rank.to_string()),
            ("MASTER_ADDR".into(), master_addr.to_string()),
            ("MASTER_PORT".into(), master_port.to_string()),
            // NVLink multicast must stay off on the shared machines.
            ("NCCL_NVLS_ENABLE".into(), "0".into()),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn parses_launcher_variables() {
        assert_eq!(LaunchEnv::parse(env(&[])).unwrap(), None);
        let e = LaunchEnv::parse(env(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("NCCL_COMM_ID", "10.0.0.1:29500"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            e,
            LaunchEnv { rank: 2, world: 4, local_rank: 1, local_world: None, comm_id: "10.0.0.1:29500".into() }
        );
        let e = LaunchEnv::parse(env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "node1"),
            ("MASTER_PORT", "1234"),
        ]))
        .unwrap()
        .unwrap();
        // NCCL's root on the port after torchrun's store.
        assert_eq!((e.local_rank, e.comm_id.as_str()), (0, "node1:1235"));
        // torchrun on 2 hosts of 4 GPUs.
        let e = LaunchEnv::parse(env(&[
            ("RANK", "6"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "2"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "node1"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((e.rank, e.local_rank, e.node()), (6, 2, Some((2, 1))));
        // srun: 2 nodes x 2 tasks.
        let e = LaunchEnv::parse(env(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_TASKS_PER_NODE", "2(x2)"),
            ("MASTER_ADDR", "n0"),
            ("MASTER_PORT", "6000"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((e.rank, e.world, e.local_rank, e.node(), e.comm_id.as_str()), (3, 4, 1, Some((2, 1)), "n0:6001"));
    }

    #[test]
    fn ranks_per_node_from_torchrun_else_slurm() {
        assert_eq!(ranks_per_node(env(&[])).unwrap(), None);
        assert_eq!(ranks_per_node(env(&[("SLURM_NTASKS_PER_NODE", "2")])).unwrap(), Some(2));
        // Without --ntasks-per-node, Slurm's list, where the nodes are alike.
        for (list, want) in [
            ("2(x3)", Some(2)),
            ("4", Some(4)),
            ("4,4", Some(4)),
            (" 8(x2) ", Some(8)),
            ("2(x3),1", None),
            ("4,2", None),
            ("4(y2)", None),
            ("0", None),
            ("", None),
        ] {
            assert_eq!(ranks_per_node(env(&[("SLURM_TASKS_PER_NODE", list)])).unwrap(), want, "{list:?}");
        }
        let both = [("SLURM_NTASKS_PER_NODE", "4"), ("SLURM_TASKS_PER_NODE", "2(x4)")];
        assert_eq!(ranks_per_node(env(&both)).unwrap(), Some(4));
        let both = [("SLURM_NTASKS_PER_NODE", "4"), ("LOCAL_WORLD_SIZE", "2")];
        assert_eq!(ranks_per_node(env(&both)).unwrap(), Some(2));
        for bad in [("LOCAL_WORLD_SIZE", "two"), ("SLURM_NTASKS_PER_NODE", "0")] {
            let e = ranks_per_node(env(&[bad])).unwrap_err().to_string();
            assert!(e.contains("launcher environment"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn rejects_bad_variables() {
        for bad in [
            vec![("RANK", "4"), ("WORLD_SIZE", "4"), ("NCCL_COMM_ID", "h:1")],
            vec![("RANK", "x"), ("WORLD_SIZE", "4"), ("NCCL_COMM_ID", "h:1")],
            vec![("RANK", "0"), ("NCCL_COMM_ID", "h:1")],
            vec![("RANK", "0"), ("WORLD_SIZE", "2")],
            vec![("RANK", "0"), ("WORLD_SIZE", "2"), ("NCCL_COMM_ID", "nohost")],
            vec![("RANK", "0"), ("WORLD_SIZE", "2"), ("NCCL_COMM_ID", "h:0")],
            vec![("RANK", "0"), ("WORLD_SIZE", "2"), ("NCCL_COMM_ID", ":80")],
            vec![("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "65535")],
            vec![
                ("RANK", "3"),
                ("WORLD_SIZE", "6"),
                ("LOCAL_RANK", "3"),
                ("LOCAL_WORLD_SIZE", "4"),
                ("NCCL_COMM_ID", "h:1"),
            ],
            vec![("SLURM_PROCID", "0"), ("NCCL_COMM_ID", "h:1")],
        ] {
            let err = LaunchEnv::parse(env(&bad)).unwrap_err();
            assert!(
                matches!(&err, Error::InvalidArgument { what, .. } if what == "launcher environment"),
                "{bad:?}: {err}"
            );
        }
    }

    #[test]
    fn launcher_sets_what_ranks_read() {
        let vars = LaunchEnv::for_rank(1, 1, 2, 2, "10.1.1.1", 29511);
        let m: HashMap<String, String> = vars.into_iter().collect();
        assert_eq!(m["NCCL_NVLS_ENABLE"], "0");
        assert!(!m.contains_key("NCCL_COMM_ID"));
        let e = LaunchEnv::parse(|k| m.get(k).cloned()).unwrap().unwrap();
        assert_eq!((e.rank, e.world, e.local_rank, e.node()), (3, 4, 1, Some((2, 1))));
        assert_eq!(e.comm_id, "10.1.1.1:29512");
    }
}
