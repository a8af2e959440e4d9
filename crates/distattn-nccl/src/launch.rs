//! One process per GPU: the environment a launcher sets for each rank (`RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, and `NCCL_COMM_ID=host:port` for NCCL's own bootstrap — rank 0 opens the
//! bootstrap root there, every rank connects to it; no transport of our own).

use distattn_core::{Error, Result};

/// What one rank of a multi-process run reads from its environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    pub rank: usize,
    pub world: usize,
    /// GPU ordinal of this rank on its host.
    pub local_rank: usize,
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

impl LaunchEnv {
    /// Reads the variables through `get`. `Ok(None)` when `RANK` is unset (not launched).
    /// `NCCL_COMM_ID` may be replaced by `MASTER_ADDR` + `MASTER_PORT` (torchrun's names).
    pub fn parse(get: impl Fn(&str) -> Option<String>) -> Result<Option<LaunchEnv>> {
        let Some(rank) = get("RANK") else { return Ok(None) };
        let rank = parse_num("RANK", &rank)?;
        let world =
            parse_num("WORLD_SIZE", &get("WORLD_SIZE").ok_or_else(|| bad("RANK is set but WORLD_SIZE is not"))?)?;
        if world == 0 || rank >= world {
            return Err(bad(format!("RANK={rank} outside WORLD_SIZE={world}")));
        }
        let local_rank = match get("LOCAL_RANK") {
            Some(v) => parse_num("LOCAL_RANK", &v)?,
            None => rank,
        };
        let comm_id = match (get("NCCL_COMM_ID"), get("MASTER_ADDR"), get("MASTER_PORT")) {
            (Some(id), _, _) => id,
            (None, Some(a), Some(p)) => format!("{a}:{p}"),
            _ => return Err(bad("NCCL_COMM_ID (host:port) or MASTER_ADDR and MASTER_PORT must be set")),
        };
        check_comm_id(&comm_id)?;
        Ok(Some(LaunchEnv { rank, world, local_rank, comm_id }))
    }

    /// Reads the process environment.
    pub fn from_env() -> Result<Option<LaunchEnv>> {
        Self::parse(|k| std::env::var(k).ok())
    }

    /// The variables a launcher sets for rank `rank` of `world` on one host (GPU = rank).
    pub fn for_rank(rank: usize, world: usize, comm_id: &str) -> Vec<(String, String)> {
        vec![
            ("RANK".into(), rank.to_string()),
            ("WORLD_SIZE".into(), world.to_string()),
            ("LOCAL_RANK".into(), rank.to_string()),
            ("NCCL_COMM_ID".into(), comm_id.to_string()),
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
        assert_eq!(e, LaunchEnv { rank: 2, world: 4, local_rank: 1, comm_id: "10.0.0.1:29500".into() });
        let e = LaunchEnv::parse(env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "node1"),
            ("MASTER_PORT", "1234"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((e.local_rank, e.comm_id.as_str()), (0, "node1:1234"));
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
        let vars = LaunchEnv::for_rank(3, 4, "127.0.0.1:29511");
        let m: HashMap<String, String> = vars.into_iter().collect();
        assert_eq!(m["NCCL_NVLS_ENABLE"], "0");
        let e = LaunchEnv::parse(|k| m.get(k).cloned()).unwrap().unwrap();
        assert_eq!((e.rank, e.world, e.local_rank), (3, 4, 3));
    }
}
