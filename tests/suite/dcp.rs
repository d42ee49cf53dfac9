//! PyTorch DCP sharded safetensors (`checkpoint::dcp`): tune reads torch's per-rank shard files
//! (tests/fixtures/dcp, made by make_dcp_fixture.py with torch 2.15 on two gloo ranks) into the
//! tensors torch's own consolidation wrote, consolidates them into the same files, and its own
//! shard files round-trip; broken shard sets fail with the error naming file and tensor.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::Dtype;
use tune::checkpoint::dcp::{
    DcpCheckpoint, Piece, consolidate, row_range, shard_file_name, write_shard,
};
use tune::checkpoint::safetensors_io::SafetensorsFile;
use tune::checkpoint::{CheckpointError, HostTensor, StorageDtype, Weights};

use crate::support::{column, fixture, max_abs_diff, read_metrics, temp_dir, tune};

const INDEX: &str = "model.safetensors.index.json";

/// Every tensor of a consolidated directory (by its index): name -> (dtype, shape, bytes).
fn consolidated(dir: &Path) -> BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)> {
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join(INDEX)).expect("index"))
            .expect("index json");
    let mut out = BTreeMap::new();
    for (name, file) in index["weight_map"].as_object().expect("weight_map") {
        let f = SafetensorsFile::open(&dir.join(file.as_str().expect("file"))).expect("open");
        let (dtype, shape, bytes) = f.raw(name).expect("tensor");
        out.insert(name.clone(), (dtype, shape, bytes.to_vec()));
    }
    out
}

fn index_json(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join(INDEX)).expect("index")).expect("json")
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for e in std::fs::read_dir(from).expect("read_dir").flatten() {
        if e.file_type().expect("type").is_file() {
            std::fs::copy(e.path(), to.join(e.file_name())).expect("copy");
        }
    }
}

/// A scratch checkpoint directory holding a copy of torch's shard files under `sharded/`.
fn torch_shards_copy(tag: &str) -> tempfile::TempDir {
    let t = temp_dir(tag);
    copy_dir(&fixture("dcp/sharded"), &t.path().join("sharded"));
    t
}

#[test]
fn dcp_reads_torch_shards_as_torch_consolidated_them() {
    let ck = DcpCheckpoint::open(&fixture("dcp/sharded")).expect("open torch shards");
    assert_eq!(ck.world_size(), 2);
    assert_eq!(ck.num_files(), 2);
    let want = consolidated(&fixture("dcp"));
    let names: Vec<&String> = ck.names().collect();
    assert_eq!(names, want.keys().collect::<Vec<_>>());
    for (name, (dtype, shape, bytes)) in &want {
        assert_eq!(ck.dtype(name), Some(*dtype), "{name}");
        assert_eq!(ck.shape(name), Some(shape.as_slice()), "{name}");
        assert_eq!(&ck.read_bytes(name).expect("read"), bytes, "{name}");
        // A dim-0 row range is the same slice of the full bytes.
        let rows = shape[0];
        let row_bytes = bytes.len() / rows.max(1);
        for (lo, hi) in [(0, rows), (rows / 2, rows), (1.min(rows), rows), (0, 0)] {
            let got = ck.read_rows_bytes(name, lo..hi).expect("rows");
            assert_eq!(
                got,
                bytes[lo * row_bytes..hi * row_bytes],
                "{name} rows {lo}..{hi}"
            );
        }
    }
    // The odd-row, empty-piece and column-sharded tensors are there.
    assert_eq!(ck.shape("odd_rows.weight"), Some(&[7usize, 5][..]));
    assert_eq!(ck.shape("one_row.weight"), Some(&[1usize, 6][..]));
    assert_eq!(ck.shape("columns.weight"), Some(&[4usize, 5][..]));
    assert_eq!(ck.dtype("model.norm.weight"), Some(Dtype::BF16));
}

#[test]
fn dcp_weights_open_loads_sharded_dir_like_the_consolidated_one() {
    let t = torch_shards_copy("dcp-weights");
    let mut from_shards = Weights::open(t.path(), None).expect("open sharded/");
    let mut plain = Weights::open(&fixture("dcp"), None).expect("open consolidated");
    assert_eq!(from_shards.storage_dtype, plain.storage_dtype);
    let names: Vec<String> = plain.names().cloned().collect();
    for name in &names {
        assert_eq!(from_shards.dtype(name), plain.dtype(name), "{name}");
        let shape = DcpCheckpoint::open(&t.path().join("sharded"))
            .expect("open")
            .shape(name)
            .expect("shape")
            .to_vec();
        let a = from_shards.take(name, &shape).expect("take shards");
        let b = plain.take(name, &shape).expect("take plain");
        assert_eq!(a, b, "{name}");
    }
    from_shards.finish(|_| false).expect("nothing left");
    // A wrong expected shape is the usual shape error.
    let mut w = Weights::open(t.path(), None).expect("open");
    let err = w.take("odd_rows.weight", &[8, 5]).expect_err("wrong shape");
    assert!(
        matches!(err, CheckpointError::ShapeMismatch { .. }),
        "{err}"
    );
}

#[test]
fn dcp_consolidation_of_torch_shards_equals_torch_consolidation() {
    for world in [1, 2] {
        let t = torch_shards_copy("dcp-consolidate");
        let out = t.path().join("out");
        std::fs::create_dir(&out).expect("mkdir");
        // Ranks one after another, rank 0 (which writes the index) last.
        for rank in (0..world).rev() {
            let written =
                consolidate(&t.path().join("sharded"), &out, rank, world).expect("consolidate");
            if world == 2 && rank == 1 {
                // torch's rule: file k goes to rank k % world.
                assert_eq!(written, vec!["model-00001-of-00002.safetensors"]);
            }
        }
        assert_eq!(
            consolidated(&out),
            consolidated(&fixture("dcp")),
            "world {world}"
        );
        let (ours, torch) = (index_json(&out), index_json(&fixture("dcp")));
        assert_eq!(ours["weight_map"], torch["weight_map"], "world {world}");
        assert_eq!(
            ours["metadata"]["total_size"], torch["metadata"]["total_size"],
            "world {world}"
        );
        let mut files: Vec<String> = std::fs::read_dir(&out)
            .expect("ls")
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        files.sort();
        assert_eq!(
            files,
            [
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors",
                INDEX
            ]
        );
    }
}

/// Full tensors for the round trip: uneven rows, 1-D, bf16 and f16, a 2-row tensor (empty
/// pieces on 3 ranks), and which of 2 files each goes to.
fn round_trip_tensors() -> Vec<(String, HostTensor, StorageDtype, usize)> {
    let t = |shape: Vec<usize>, seed: f32| {
        let n = shape.iter().product::<usize>();
        HostTensor::new(shape, (0..n).map(|i| seed + i as f32 * 0.25).collect())
    };
    vec![
        ("a.weight".into(), t(vec![7, 3], 1.0), StorageDtype::F32, 1),
        (
            "b.weight".into(),
            t(vec![2, 5], -3.0),
            StorageDtype::BF16,
            2,
        ),
        ("c.bias".into(), t(vec![5], 0.5), StorageDtype::F16, 2),
        (
            "d.weight".into(),
            t(vec![4, 2, 3], 7.0),
            StorageDtype::F32,
            1,
        ),
    ]
}

/// Writes the round-trip tensors as `world` ranks would: every rank its dim-0 pieces, in both
/// files.
fn write_round_trip(dir: &Path, world: usize) {
    for rank in 0..world {
        for file in 1..=2 {
            let pieces: Vec<Piece> = round_trip_tensors()
                .into_iter()
                .filter(|(_, _, _, k)| *k == file)
                .filter_map(|(name, full, dtype, _)| {
                    Piece::rows_of(name, &full, dtype, rank, world)
                })
                .collect();
            let path = write_shard(dir, rank, world, file, 2, &pieces).expect("write shard");
            assert_eq!(path, dir.join(shard_file_name(rank, file, 2)));
        }
    }
}

#[test]
fn dcp_writer_round_trips_and_consolidates_on_every_world_size() {
    for world in [1, 2, 3] {
        let t = temp_dir("dcp-roundtrip");
        let sharded = t.path().join("sharded");
        std::fs::create_dir(&sharded).expect("mkdir");
        write_round_trip(&sharded, world);
        // torch's metadata keys on every file.
        let f =
            SafetensorsFile::open(&sharded.join(shard_file_name(world - 1, 2, 2))).expect("open");
        let meta = f.user_metadata().expect("metadata");
        assert_eq!(meta.get("DCP_VERSION").map(String::as_str), Some("1.0"));
        assert_eq!(meta.get("format").map(String::as_str), Some("pt"));
        let info: serde_json::Value =
            serde_json::from_str(meta.get("DCP_SHARDING_INFO").expect("info")).expect("json");
        let b_rows = row_range(2, world - 1, world);
        assert_eq!(
            info["b.weight"]["saved_offsets"],
            serde_json::json!([b_rows.start, 0])
        );
        if world == 3 {
            // Rank 3's piece of the 2-row tensor is empty, at offset 2, as torch writes it.
            assert_eq!(f.shape("b.weight"), Some(vec![0, 5]));
        }

        let ck = DcpCheckpoint::open(&sharded).expect("open");
        assert_eq!(ck.world_size(), world);
        for (name, full, dtype, k) in round_trip_tensors() {
            assert_eq!(ck.file_index(&name), Some(k));
            assert_eq!(
                ck.read_bytes(&name).expect("read"),
                dtype.encode(&full.data),
                "{name} W={world}"
            );
            // Re-sharding: any other world size's dim-0 shards put back together.
            for other in [1, 2, 4] {
                let parts: Vec<HostTensor> = (0..other)
                    .map(|r| {
                        ck.read_rows(&name, row_range(full.shape[0], r, other))
                            .expect("rows")
                    })
                    .collect();
                let whole = HostTensor::concat_rows(&parts);
                assert_eq!(
                    whole,
                    ck.read(&name).expect("read"),
                    "{name} W={world} -> {other}"
                );
            }
        }

        let out = t.path().join("out");
        std::fs::create_dir(&out).expect("mkdir");
        for rank in (0..world).rev() {
            consolidate(&sharded, &out, rank, world).expect("consolidate");
        }
        let got = consolidated(&out);
        for (name, full, dtype, k) in round_trip_tensors() {
            let (d, shape, bytes) = &got[&name];
            assert_eq!((*d, shape), (dtype.safetensors(), &full.shape), "{name}");
            assert_eq!(bytes, &dtype.encode(&full.data), "{name} W={world}");
            assert_eq!(
                index_json(&out)["weight_map"][&name],
                format!("model-{k:05}-of-00002.safetensors")
            );
        }
        let total: usize = round_trip_tensors()
            .iter()
            .map(|(_, full, dtype, _)| full.numel() * dtype.bytes_per_element())
            .sum();
        assert_eq!(index_json(&out)["metadata"]["total_size"], total);
    }
}

/// Writes `a.weight` [6, 2] f32 as the pieces (rank, rows) say, all in file 1 of 1.
fn write_pieces(dir: &Path, world: usize, pieces: &[(usize, std::ops::Range<usize>)]) {
    let full = HostTensor::new(vec![6, 2], (0..12).map(|i| i as f32).collect());
    for (rank, rows) in pieces {
        let piece = Piece::from_host(
            "a.weight",
            &full.rows(rows.start, rows.len()),
            StorageDtype::F32,
            vec![6, 2],
            vec![rows.start, 0],
        );
        write_shard(dir, *rank, world, 1, 1, &[piece]).expect("write");
    }
}

fn open_err(dir: &Path) -> CheckpointError {
    match DcpCheckpoint::open(dir) {
        Ok(_) => panic!("{} opened", dir.display()),
        Err(e) => e,
    }
}

#[test]
fn dcp_gap_in_the_pieces_is_named() {
    let t = temp_dir("dcp-gap");
    write_pieces(t.path(), 2, &[(0, 0..2), (1, 3..6)]);
    let err = open_err(t.path());
    let msg = err.to_string();
    assert!(matches!(err, CheckpointError::DcpPieces { .. }), "{msg}");
    assert!(msg.contains("a.weight") && msg.contains("gap"), "{msg}");
    assert!(
        msg.contains("shard-00002-model-00001-of-00001.safetensors"),
        "{msg}"
    );
}

#[test]
fn dcp_overlapping_pieces_are_named() {
    let t = temp_dir("dcp-overlap");
    write_pieces(t.path(), 2, &[(0, 0..4), (1, 3..6)]);
    let err = open_err(t.path());
    let msg = err.to_string();
    assert!(matches!(err, CheckpointError::DcpPieces { .. }), "{msg}");
    assert!(
        msg.contains("a.weight") && msg.contains("overlaps"),
        "{msg}"
    );
    assert!(
        msg.contains("shard-00001-model-00001-of-00001.safetensors"),
        "{msg}"
    );
    assert!(
        msg.contains("shard-00002-model-00001-of-00001.safetensors"),
        "{msg}"
    );
}

#[test]
fn dcp_missing_rank_file_is_named() {
    let t = temp_dir("dcp-missing");
    write_pieces(t.path(), 3, &[(0, 0..2), (1, 2..4), (2, 4..6)]);
    std::fs::remove_file(t.path().join(shard_file_name(1, 1, 1))).expect("rm");
    let err = open_err(t.path());
    assert!(
        matches!(
            err,
            CheckpointError::DcpMissingRank {
                missing: 2,
                highest: 3,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("shard-00002-"), "{err}");
}

#[test]
fn dcp_missing_last_rank_is_caught_by_the_recorded_full_shape() {
    let t = temp_dir("dcp-missing-last");
    write_pieces(t.path(), 3, &[(0, 0..2), (1, 2..4), (2, 4..6)]);
    std::fs::remove_file(t.path().join(shard_file_name(2, 1, 1))).expect("rm");
    let err = open_err(t.path());
    let msg = err.to_string();
    assert!(matches!(err, CheckpointError::DcpPieces { .. }), "{msg}");
    assert!(
        msg.contains("a.weight") && msg.contains("[6, 2]") && msg.contains("last rank"),
        "{msg}"
    );
}

#[test]
fn dcp_truncated_shard_file_is_named() {
    let t = torch_shards_copy("dcp-truncated");
    let path = t
        .path()
        .join("sharded/shard-00002-model-00001-of-00002.safetensors");
    let len = std::fs::metadata(&path).expect("stat").len();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("open");
    f.set_len(len - 100).expect("truncate");
    let err = open_err(&t.path().join("sharded"));
    assert!(
        matches!(err, CheckpointError::BadSafetensors { .. }),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("shard-00002-model-00001-of-00002.safetensors"),
        "{err}"
    );
}

#[test]
fn dcp_file_without_sharding_info_is_named() {
    let t = temp_dir("dcp-nometa");
    let path = t.path().join(shard_file_name(0, 1, 1));
    tune::checkpoint::safetensors_io::write_file(
        &path,
        &[("a".into(), HostTensor::new(vec![2], vec![1.0, 2.0]))],
        StorageDtype::F32,
    )
    .expect("write");
    let err = open_err(t.path());
    let msg = err.to_string();
    assert!(
        msg.contains("DCP_SHARDING_INFO") && msg.contains("shard-00001-model-00001-of-00001"),
        "{msg}"
    );
}

fn listing(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("ls")
        .flatten()
        .map(|e| e.path())
        .collect();
    v.sort();
    v
}

#[test]
fn dcp_cli_consolidate_writes_torch_equal_files_and_refuses_to_overwrite() {
    let t = torch_shards_copy("dcp-cli");
    let dir = t.path().to_str().expect("utf-8");
    let out = tune(&["checkpoints", "consolidate", dir]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(consolidated(t.path()), consolidated(&fixture("dcp")));
    assert_eq!(
        index_json(t.path())["weight_map"],
        index_json(&fixture("dcp"))["weight_map"]
    );
    // Nothing staged is left behind.
    assert!(
        listing(t.path())
            .iter()
            .all(|p| !p.to_string_lossy().contains(".tune-consolidate")),
        "{:?}",
        listing(t.path())
    );
    // Again: refused, and the files are untouched.
    let before = consolidated(t.path());
    let again = tune(&["checkpoints", "consolidate", dir]);
    assert!(!again.status.success());
    let stderr = String::from_utf8_lossy(&again.stderr);
    assert!(stderr.contains("already exists"), "{stderr}");
    assert_eq!(consolidated(t.path()), before);
}

#[test]
fn dcp_cli_consolidate_failure_leaves_no_output() {
    let t = temp_dir("dcp-cli-fail");
    let sharded = t.path().join("sharded");
    std::fs::create_dir(&sharded).expect("mkdir");
    write_pieces(&sharded, 2, &[(0, 0..2), (1, 3..6)]);
    let before = listing(t.path());
    let out = tune(&[
        "checkpoints",
        "consolidate",
        t.path().to_str().expect("utf-8"),
    ]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("gap") && stderr.contains("a.weight"),
        "{stderr}"
    );
    assert_eq!(listing(t.path()), before, "consolidate left files behind");

    // Without sharded/ at all: a clear refusal, nothing written.
    let empty = temp_dir("dcp-cli-empty");
    let out = tune(&[
        "checkpoints",
        "consolidate",
        empty.path().to_str().expect("utf-8"),
    ]);
    assert!(!out.status.success());
    assert!(listing(empty.path()).is_empty());
}

#[test]
fn dcp_cli_checkpoints_listing_still_parses() {
    let t = temp_dir("dcp-cli-list");
    let out = tune(&[
        "checkpoints",
        t.path().to_str().expect("utf-8"),
        "--no-verify",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let none = tune(&["checkpoints"]);
    assert_eq!(
        none.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&none.stderr)
    );
}

/// For benches/check_dcp_with_torch.py (not a check by itself): with `TUNE_DCP_CHECK_DIR` set,
/// writes tiny-llama's weights as 3 ranks' shard files (half the tensors in bf16, 3 output
/// files) into `$TUNE_DCP_CHECK_DIR/sharded/`, and tune's consolidation of them into
/// `$TUNE_DCP_CHECK_DIR/tune-consolidated/`. Without it, does nothing.
#[test]
fn dcp_write_for_torch_check() {
    let Some(dir) = std::env::var_os("TUNE_DCP_CHECK_DIR").map(PathBuf::from) else {
        return;
    };
    let (world, files) = (3, 3);
    let sharded = dir.join("sharded");
    let out = dir.join("tune-consolidated");
    for d in [&sharded, &out] {
        if d.exists() {
            std::fs::remove_dir_all(d).expect("rm");
        }
        std::fs::create_dir_all(d).expect("mkdir");
    }
    let mut weights = Weights::open(&fixture("tiny-llama"), None).expect("tiny-llama");
    let mut names: Vec<String> = weights.names().cloned().collect();
    names.sort();
    let sf = SafetensorsFile::open(&fixture("tiny-llama/model.safetensors")).expect("open");
    let tensors: Vec<(String, HostTensor, StorageDtype, usize)> = names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let shape = sf.shape(name).expect("shape");
            let t = weights.take(name, &shape).expect("take");
            let dtype = if i % 2 == 0 {
                StorageDtype::F32
            } else {
                StorageDtype::BF16
            };
            (name.clone(), t, dtype, i % files + 1)
        })
        .collect();
    for rank in 0..world {
        for file in 1..=files {
            let pieces: Vec<Piece> = tensors
                .iter()
                .filter(|(_, _, _, k)| *k == file)
                .filter_map(|(name, full, dtype, _)| {
                    Piece::rows_of(name.clone(), full, *dtype, rank, world)
                })
                .collect();
            write_shard(&sharded, rank, world, file, files, &pieces).expect("write");
        }
    }
    for rank in (0..world).rev() {
        consolidate(&sharded, &out, rank, world).expect("consolidate");
    }
}

/// A model PyTorch saved from two FSDP ranks (`HuggingFaceStorageWriter`, shard files only:
/// tests/fixtures/make_dcp_model_fixture.py) is a checkpoint tune trains from, on one device
/// and on two FSDP workers: the same losses and weights as from the consolidated model.
#[test]
fn training_starts_from_a_model_torch_saved_sharded() {
    let torch_dir = fixture("dcp-tiny-llama");
    assert!(!torch_dir.join("model.safetensors").exists());
    let dir = format!("checkpointer.checkpoint_dir={}", torch_dir.display());
    // The config names `model.safetensors`; a directory of shards is loaded whole.
    let from = [dir.as_str(), "checkpointer.checkpoint_files=null"];
    let common = ["max_steps_per_epoch=3", "optimizer.lr=1e-4"];
    let run = |workers: usize, extra: &[&str]| {
        let out = temp_dir("dcp-train");
        let mut args = common.to_vec();
        args.extend_from_slice(extra);
        let (recipe, batch) = match workers {
            1 => ("full_finetune_single_device", 4),
            _ => ("full_finetune_distributed", 2),
        };
        crate::distributed::train(workers, recipe, "tiny/full", &out, batch, &args);
        out
    };
    let losses = |dir: &tempfile::TempDir| {
        let metrics = read_metrics(&dir.path().join("logs/metrics.jsonl"));
        column(&metrics, "loss")
    };
    let reference = run(1, &[]);
    for workers in [1, 2] {
        let got = run(workers, &from);
        let (g, w) = (losses(&got), losses(&reference));
        assert_eq!(g.len(), 3);
        for (a, b) in g.iter().zip(&w) {
            assert!(
                (a - b).abs() <= 1e-4 * b.abs(),
                "{workers} workers: {g:?} vs {w:?}"
            );
        }
        let mut tune_model = Weights::open(&got.path().join("epoch_0"), None).expect("tune's");
        let mut want = Weights::open(&reference.path().join("epoch_0"), None).expect("reference");
        let names: Vec<String> = want.names().cloned().collect();
        for name in names {
            let shape = SafetensorsFile::open(&reference.path().join("epoch_0/model.safetensors"))
                .expect("open")
                .shape(&name)
                .expect("shape");
            let d = max_abs_diff(
                &name,
                &tune_model.take(&name, &shape).expect("tune's"),
                &want.take(&name, &shape).expect("want"),
            );
            assert!(d <= 1e-5, "{workers} workers: {name} differs by {d}");
        }
    }
}

/// FSDP's per-rank load: each rank of 3 builds the model from its rows of every weight only
/// (read from the safetensors file, or from torch's shard files), and those are exactly the
/// rows of the whole model; the shards record every weight's whole shape.
#[test]
fn each_rank_loads_only_its_rows_of_every_weight() {
    for source in ["tiny-llama", "dcp-tiny-llama"] {
        each_rank_holds_its_rows(source, "tiny-llama", 3);
    }
}

/// Loads checkpoint `source` as each of `world` ranks does under FSDP and checks each holds
/// exactly its rows of every weight of the whole load of `whole` (the same model), the shards
/// recording the whole shapes. Returns the weights' names.
pub(crate) fn each_rank_holds_its_rows(source: &str, whole: &str, world: usize) -> Vec<String> {
    use tune::model_io::hf::{load_model, load_model_rows};
    use tune::models::build::RowsOf;
    type B = crate::support::Cpu;
    let device = Default::default();
    let whole = load_model::<B>(&fixture(whole), None, &device)
        .expect("whole")
        .model
        .named_params();
    for rank in 0..world {
        let rows = RowsOf { rank, world };
        let model = load_model_rows::<B>(
            &fixture(source),
            None,
            &device,
            rows,
            tune::models::BaseWeights::Float,
        )
        .expect("rows")
        .model;
        let shards = model.shards.clone().expect("the load records its shards");
        let params = model.named_params();
        assert_eq!(params.len(), whole.len());
        for (got, want) in params.iter().zip(&whole) {
            assert_eq!(got.name, want.name);
            assert_eq!(
                shards.full_shape(&got.id),
                Some(want.value.shape.as_slice()),
                "{source} {}",
                got.name
            );
            let r = row_range(want.value.shape[0], rank, world);
            assert_eq!(
                got.value,
                want.value.rows(r.start, r.len()),
                "{source} {}",
                got.name
            );
        }
    }
    whole.into_iter().map(|p| p.name).collect()
}

/// FSDP's per-rank load of an NF4 base (QLoRA): each rank of 1, 2, 3 and 5 quantizes its rows
/// of every decoder linear alone, from reads of a few rows at a time, and holds exactly what
/// quantizing the whole weight and keeping its rows gives: codes and block scales, bit for
/// bit, in both row orders (q/k in torchtune's RoPE order) and both compute dtypes; the whole
/// weight is built on no rank.
#[test]
fn each_rank_quantizes_its_rows_of_an_nf4_base_as_the_whole_weight() {
    use tune::model_io::hf::{load_model_rows, load_model_with};
    use tune::models::BaseWeights;
    use tune::models::build::RowsOf;
    use tune::modules::nf4::Nf4Dtype;
    type B = crate::support::Cpu;
    let device = Default::default();
    // Sized for NF4 (every linear a whole number of 16384-value scaler blocks); 5 ranks' rows
    // cross scaler blocks.
    let dir = fixture("tiny-llama-nf4");
    for compute in [Nf4Dtype::F32, Nf4Dtype::Bf16] {
        let base = BaseWeights::Nf4(compute);
        let mut whole = load_model_with::<B>(&dir, None, &device, base)
            .expect("whole")
            .model;
        let linears: Vec<(String, tune::modules::frozen_nf4::FrozenNf4)> = whole
            .linears_mut()
            .into_iter()
            .filter_map(|(name, l)| Some((name, l.nf4()?.clone())))
            .collect();
        assert_eq!(
            linears.len(),
            7 * whole.args.num_layers,
            "every decoder linear in NF4"
        );
        for world in [1, 2, 3, 5] {
            for rank in 0..world {
                let mut model =
                    load_model_rows::<B>(&dir, None, &device, RowsOf { rank, world }, base)
                        .expect("rows")
                        .model;
                let held: Vec<_> = model
                    .linears_mut()
                    .into_iter()
                    .filter(|(name, _)| name.starts_with("model.layers."))
                    .collect();
                assert_eq!(held.len(), linears.len());
                for ((name, linear), (want_name, q)) in held.into_iter().zip(&linears) {
                    assert_eq!(&name, want_name);
                    assert!(linear.nf4().is_none(), "{name}: the whole weight is held");
                    let got = linear.nf4_rows().expect("this rank's rows");
                    let r = row_range(q.shape()[0], rank, world);
                    let want = q.rows(r).expect("whole blocks");
                    assert_eq!(got.codes, want.codes, "{name} {rank}/{world}");
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&got.scales),
                        bits(&want.scales),
                        "{name} {rank}/{world}"
                    );
                    assert_eq!(got.order, want.order, "{name}");
                }
            }
        }
    }
}
