//! Behavioural tests of the checkpoint client (real files in a temp dir; gated
//! writers instead of sleeps to control ordering).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, Sender};
use std::time::Duration;

use sha2::{Digest, Sha256};

use super::*;

/// A fresh directory, removed on drop.
fn test_dir(tag: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("tune-ckpt-test-{tag}-"))
        .tempdir()
        .expect("create test dir")
}

fn meta(step: u64) -> CheckpointMeta {
    let mut m = CheckpointMeta::new("full_finetune", "cfg-abc", step, step / 100);
    m.steps_in_epoch = Some(100);
    m.extra = serde_json::json!({ "rng": [1, 2, 3], "note": format!("at {step}") });
    m
}

type Files = Vec<(&'static str, Vec<u8>)>;

fn write_files(dir: &Path, files: &Files) -> Result<(), WriteError> {
    for (rel, bytes) in files {
        let path = dir.join(rel);
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).map_err(|e| WriteError::io(parent, e))?;
        }
        fs::write(&path, bytes).map_err(|e| WriteError::io(&path, e))?;
    }
    Ok(())
}

fn files_for(step: u64) -> Files {
    vec![
        (
            "model.safetensors",
            format!("weights at step {step}").into_bytes(),
        ),
        ("optim/state.bin", vec![step as u8; 3000]),
    ]
}

fn request(name: &str, step: u64) -> SaveRequest {
    let files = files_for(step);
    SaveRequest::new(name, meta(step), move |dir: &Path| write_files(dir, &files))
}

/// A writer that reports when it starts and then blocks until released (or
/// until the gate is dropped).
struct Gate {
    started: Receiver<PathBuf>,
    go: Sender<()>,
}

impl Gate {
    fn wait_started(&self) -> PathBuf {
        self.started
            .recv_timeout(Duration::from_secs(30))
            .expect("writer never started")
    }
    fn release(&self) {
        let _ = self.go.send(());
    }
}

fn gated_request(name: &str, step: u64) -> (SaveRequest, Gate) {
    let (started_tx, started) = mpsc::channel();
    let (go, go_rx) = mpsc::channel::<()>();
    let files = files_for(step);
    let req = SaveRequest::new(name, meta(step), move |dir: &Path| {
        let _ = started_tx.send(dir.to_path_buf());
        let _ = go_rx.recv();
        write_files(dir, &files)
    });
    (req, Gate { started, go })
}

fn sha_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn temp_dirs(out: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(out)
        .expect("read out")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".tmp-"))
        .collect();
    v.sort();
    v
}

fn client(out: PathBuf, keep_last_n: Option<usize>) -> CheckpointClient {
    CheckpointClient::new(out, ClientOptions { keep_last_n }).expect("client")
}

fn read_manifest(dir: &Path) -> serde_json::Value {
    serde_json::from_slice(&fs::read(dir.join(METADATA_FILE)).expect("metadata")).expect("json")
}

fn write_manifest(dir: &Path, value: &serde_json::Value) {
    fs::write(
        dir.join(METADATA_FILE),
        serde_json::to_vec(value).expect("ser"),
    )
    .expect("write");
}

#[test]
fn save_publishes_all_files_with_checksums_and_metadata() {
    let t = test_dir("publish");
    let out = t.path().join("out");
    let mut c = client(out.clone(), None);
    let report = c.save(request("step_120", 120)).expect("save");
    assert_eq!(report.previous, None);
    assert!(report.published.is_none());
    let published = c.wait().expect("wait").expect("published");
    assert_eq!(published.dir, out.join("step_120"));
    assert_eq!(c.last_complete(), Some("step_120"));
    assert!(temp_dirs(&out).is_empty());

    let json = read_manifest(&published.dir);
    assert_eq!(json["format_version"], 1);
    assert_eq!(json["tune_version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(json["recipe"], "full_finetune");
    assert_eq!(json["config_hash"], "cfg-abc");
    assert_eq!(json["step"], 120);
    assert_eq!(json["epoch"], 1);
    assert_eq!(json["steps_in_epoch"], 100);
    assert_eq!(json["extra"]["note"], "at 120");
    assert!(json["created_unix"].as_u64().expect("created") > 1_600_000_000);
    let files = json["files"].as_array().expect("files");
    assert_eq!(files.len(), 2);
    for (rel, bytes) in files_for(120) {
        let rec = files
            .iter()
            .find(|f| f["path"] == rel)
            .expect("file recorded");
        assert_eq!(rec["size"], bytes.len() as u64);
        assert_eq!(rec["sha256"], sha_hex(&bytes));
        assert_eq!(fs::read(published.dir.join(rel)).expect("file"), bytes);
    }
    assert_eq!(published.manifest.meta, meta(120));
    assert_eq!(
        verify(&published.dir, true).expect("verify"),
        published.manifest
    );
    // Independent check of the hex encoding.
    assert_eq!(
        sha_hex(b"abc"),
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    );
    let tmp = t.path().join("abc");
    fs::write(&tmp, b"abc").expect("write");
    assert_eq!(fsutil::hash_file(&tmp).expect("hash").1, sha_hex(b"abc"));
}

#[test]
fn nothing_is_published_while_the_writer_runs() {
    let t = test_dir("atomic");
    let out = t.path().join("out");
    let mut c = client(out.clone(), None);
    c.save_blocking(request("step_10", 10)).expect("first");
    let (req, gate) = gated_request("step_20", 20);
    c.save(req).expect("save");
    let writing_in = gate.wait_started();
    assert_eq!(
        writing_in,
        out.join(format!(".tmp-step_20-{}", std::process::id()))
    );
    assert!(writing_in.is_dir());
    assert!(!out.join("step_20").exists());
    let latest = latest_complete(&out).expect("latest").expect("some");
    assert_eq!(latest.name, "step_10");
    let entries = list_checkpoints(&out).expect("list");
    let temp = entries.iter().find(|e| e.temporary).expect("temp listed");
    assert!(matches!(temp.status, CheckpointStatus::Incomplete { .. }));
    assert_eq!(temp.step, Some(20));

    gate.release();
    let published = c.wait().expect("wait").expect("published");
    assert_eq!(published.name, "step_20");
    assert_eq!(
        latest_complete(&out).expect("latest").expect("some").name,
        "step_20"
    );
    assert!(!writing_in.exists());
}

#[test]
fn at_most_one_save_in_flight() {
    let t = test_dir("inflight");
    let out = t.path().join("out");
    let mut c = client(out.clone(), None);
    let (req, gate) = gated_request("step_1", 1);
    c.save(req).expect("first save");
    assert!(c.is_saving());
    gate.wait_started();

    // The second writer records whether the first was already published when it ran.
    let (seen_tx, seen_rx) = mpsc::channel();
    let second = SaveRequest::new("step_2", meta(2), move |dir: &Path| {
        let first = dir.parent().map(|p| p.join("step_1"));
        let published = first.is_some_and(|d| verify(&d, true).is_ok());
        let _ = seen_tx.send(published);
        write_files(dir, &files_for(2))
    });
    let releaser = std::thread::spawn(move || {
        // Gives `save` time to block on the first save before it is released.
        std::thread::sleep(Duration::from_millis(30));
        gate.release();
    });
    let report = c.save(second).expect("second save");
    assert!(report.waited > Duration::ZERO);
    assert_eq!(report.previous.expect("previous").name, "step_1");
    c.wait().expect("wait").expect("published");
    assert!(
        seen_rx.recv().expect("second ran"),
        "step_1 was not published before step_2 started"
    );
    releaser.join().expect("releaser");
    assert_eq!(c.wait().expect("nothing in flight"), None);
}

#[test]
fn background_failure_surfaces_at_next_save_and_loses_nothing() {
    let t = test_dir("failure");
    let out = t.path().join("out");
    let mut c = client(out.clone(), None);
    c.save_blocking(request("step_80", 80)).expect("step_80");
    let failing = SaveRequest::new("step_100", meta(100), |dir: &Path| {
        let path = dir.join("model.safetensors");
        fs::write(&path, b"half a model").map_err(|e| WriteError::io(&path, e))?;
        Err(WriteError::io(
            path,
            io::Error::from(io::ErrorKind::StorageFull),
        ))
    });
    c.save(failing).expect("failure is only seen later");
    let err = c
        .save(request("step_120", 120))
        .expect_err("previous failure must surface");
    let msg = err.to_string();
    assert!(
        matches!(err, ClientError::BackgroundSaveFailed { .. }),
        "{err:?}"
    );
    assert!(
        msg.contains("the background save of step_100 failed: "),
        "{msg}"
    );
    assert!(
        msg.contains("no checkpoint was lost: the last complete one is step_80"),
        "{msg}"
    );
    assert!(msg.contains("disk is full"), "{msg}");
    assert!(msg.contains("model.safetensors"), "{msg}");
    assert!(temp_dirs(&out).is_empty(), "{:?}", temp_dirs(&out));
    assert!(!out.join("step_100").exists());
    assert!(
        !out.join("step_120").exists(),
        "a request after a failure is not started"
    );
    verify(&out.join("step_80"), true).expect("previous checkpoint intact");
    assert_eq!(
        latest_complete(&out).expect("latest").expect("some").name,
        "step_80"
    );
    // Reported once; saving works again afterwards.
    c.save(request("step_120", 120)).expect("retry");
    assert_eq!(c.wait().expect("wait").expect("published").name, "step_120");
}

#[test]
fn background_panic_surfaces_at_wait() {
    let t = test_dir("panic");
    let out = t.path().join("out");
    let mut c = client(out.clone(), None);
    c.save(SaveRequest::new("step_5", meta(5), |_dir: &Path| {
        panic!("serializer bug")
    }))
    .expect("save");
    let msg = c.wait().expect_err("panic must surface").to_string();
    assert!(msg.contains("the writer panicked: serializer bug"), "{msg}");
    assert!(msg.contains("there is no complete checkpoint in"), "{msg}");
    assert!(temp_dirs(&out).is_empty());
}

#[test]
fn unwritable_output_dir_fails_with_the_path() {
    let t = test_dir("readonly");
    let out = t.path().join("out");
    let mut c = client(out.clone(), None);
    c.save_blocking(request("step_1", 1)).expect("step_1");

    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(&out, fs::Permissions::from_mode(0o555)).expect("chmod");
    let probe = out.join("probe");
    let enforced = fs::write(&probe, b"x").is_err();
    let _ = fs::remove_file(&probe);
    if enforced {
        c.save(request("step_2", 2)).expect("started");
        let err = c.wait().expect_err("read-only output dir");
        let msg = err.to_string();
        assert!(
            msg.contains("the background save of step_2 failed"),
            "{msg}"
        );
        assert!(msg.contains(&out.display().to_string()), "{msg}");
        assert!(msg.contains("writable"), "{msg}");
        assert!(msg.contains("the last complete one is step_1"), "{msg}");
    } else {
        eprintln!("running as root: permissions are not enforced, skipping the chmod part");
    }
    fs::set_permissions(&out, fs::Permissions::from_mode(0o755)).expect("chmod back");
    verify(&out.join("step_1"), true).expect("previous intact");

    // Works as root too: the publish target is occupied by a regular file.
    fs::write(out.join("step_3"), b"not a dir").expect("file");
    let err = c
        .save_blocking(request("step_3", 3))
        .expect_err("cannot publish");
    let msg = err.to_string();
    assert!(msg.contains("saving checkpoint step_3 failed"), "{msg}");
    assert!(msg.contains("is not a directory"), "{msg}");
    assert!(temp_dirs(&out).is_empty());
    assert_eq!(fs::read(out.join("step_3")).expect("file"), b"not a dir");

    // And the output dir itself cannot be created (a file is in the way).
    let blocked = t.path().join("file");
    fs::write(&blocked, b"x").expect("file");
    let err = CheckpointClient::new(blocked.join("out"), ClientOptions::default())
        .err()
        .expect("cannot create output dir");
    assert!(
        err.to_string().contains(&blocked.display().to_string()),
        "{err}"
    );
}

#[test]
fn keep_last_n_prunes_only_after_the_new_checkpoint_is_complete() {
    let t = test_dir("prune");
    let out = t.path().join("out");
    let mut c = client(out.clone(), Some(2));
    c.save_blocking(request("step_1", 1)).expect("1");
    c.save_blocking(request("step_2", 2)).expect("2");
    fs::create_dir_all(out.join("step_0")).expect("incomplete dir"); // never pruned
    let (req, gate) = gated_request("step_3", 3);
    c.save(req).expect("3");
    gate.wait_started();
    assert!(out.join("step_1").exists() && out.join("step_2").exists());
    gate.release();
    c.wait().expect("wait");
    assert!(!out.join("step_1").exists());
    assert!(out.join("step_2").exists() && out.join("step_3").exists());
    assert!(out.join("step_0").exists());

    // A run resumed from an earlier step never deletes newer checkpoints.
    drop(c);
    let mut c = client(out.clone(), Some(1));
    c.save_blocking(request("step_10", 10)).expect("10");
    assert!(!out.join("step_2").exists() && !out.join("step_3").exists());
    c.save_blocking(request("step_4", 4)).expect("4");
    assert!(out.join("step_10").exists(), "newer checkpoint pruned");
    assert!(out.join("step_4").exists());
}

#[test]
fn statuses_are_reported_with_reasons() {
    let t = test_dir("status");
    let out = t.path().join("out");
    let mut c = client(out.clone(), None);
    for step in [1, 2, 3, 4, 5, 6, 7] {
        c.save_blocking(request(&format!("step_{step}"), step))
            .expect("save");
    }
    drop(c);
    // step_2: same size, flipped byte -> corrupt (checksums only).
    let model = out.join("step_2/optim/state.bin");
    let mut bytes = fs::read(&model).expect("read");
    bytes[10] ^= 0xff;
    fs::write(&model, bytes).expect("write");
    // step_3: missing file.
    fs::remove_file(out.join("step_3/model.safetensors")).expect("rm");
    // step_4: truncated file.
    fs::write(out.join("step_4/optim/state.bin"), b"short").expect("truncate");
    // step_5: written by a newer tune.
    let mut v = read_manifest(&out.join("step_5"));
    v["format_version"] = serde_json::json!(2);
    write_manifest(&out.join("step_5"), &v);
    // step_6: unreadable metadata.
    fs::write(out.join("step_6").join(METADATA_FILE), b"{ not json").expect("write");
    // step_7: no metadata at all.
    fs::remove_file(out.join("step_7").join(METADATA_FILE)).expect("rm");
    // Not checkpoints: ignored.
    fs::create_dir_all(out.join("logs")).expect("logs");
    fs::write(out.join("step_99"), b"a file").expect("file");

    let entries = list_checkpoints(&out).expect("list");
    let names: Vec<_> = entries.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "step_1", "step_2", "step_3", "step_4", "step_5", "step_6", "step_7"
        ]
    );
    let reason = |i: usize| match &entries[i].status {
        CheckpointStatus::Incomplete { reason } => reason.clone(),
        other => panic!("{} is {other:?}", entries[i].name),
    };
    assert!(entries[0].status.is_complete());
    assert!(entries[1].status.is_complete(), "cheap checks do not hash");
    assert!(reason(2).contains("missing file model.safetensors"));
    assert!(reason(3).contains("optim/state.bin is 5 bytes, expected 3000"));
    assert_eq!(
        entries[4].status,
        CheckpointStatus::FromTheFuture { version: 2 }
    );
    assert!(reason(5).contains("unreadable tune_checkpoint.json"));
    assert!(reason(6).contains("no tune_checkpoint.json"));

    let verified = list_checkpoints_verified(&out, true).expect("list");
    match &verified[1].status {
        CheckpointStatus::Corrupt { reason } => {
            assert!(
                reason.contains("checksum mismatch in optim/state.bin"),
                "{reason}"
            )
        }
        other => panic!("{other:?}"),
    }
    let err = verify(&out.join("step_2"), true).expect_err("corrupt");
    assert!(matches!(err, VerifyError::Corrupt { .. }));
    assert!(err.to_string().contains("step_2"));
    verify(&out.join("step_2"), false).expect("sizes still match");
    let err = verify(&out.join("step_5"), false).expect_err("future");
    assert!(err.to_string().contains("upgrade tune"), "{err}");
    let err = verify(&out.join("step_7"), false).expect_err("incomplete");
    assert!(err.to_string().contains("cannot be resumed from"), "{err}");

    // Neither incomplete nor future checkpoints are resumed from.
    assert_eq!(
        latest_complete(&out).expect("latest").expect("some").name,
        "step_2"
    );
    // With checksums the corrupt newest one is skipped too.
    assert_eq!(
        latest_verified(&out).expect("latest").expect("some").name,
        "step_1"
    );

    let report = format_report(&verified);
    assert!(report.starts_with("NAME"), "{report}");
    for needle in [
        "step_1",
        "complete",
        "corrupt: checksum mismatch in optim/state.bin",
        "incomplete: missing file model.safetensors",
        "incomplete: optim/state.bin is 5 bytes, expected 3000",
        "upgrade tune",
        "incomplete: no tune_checkpoint.json",
        "2.9 KiB",
    ] {
        assert!(report.contains(needle), "missing {needle:?} in\n{report}");
    }
    assert_eq!(report.lines().count(), 8);
}

#[test]
fn future_metadata_with_unknown_fields_is_not_misread() {
    let t = test_dir("future");
    let out = t.path().join("out");
    let mut c = client(out.clone(), None);
    c.save_blocking(request("epoch_0", 50)).expect("save");
    drop(c);
    let dir = out.join("epoch_0");
    write_manifest(
        &dir,
        &serde_json::json!({ "format_version": 7, "shards": "new layout" }),
    );
    assert_eq!(
        inspect(&dir, false),
        CheckpointStatus::FromTheFuture { version: 7 }
    );
    assert_eq!(latest_complete(&out).expect("latest"), None);
    let entries = list_checkpoints(&out).expect("list");
    assert_eq!(entries[0].epoch, Some(0));
    assert_eq!(entries[0].step, None);
}

#[test]
fn clean_partial_removes_temp_dirs_only() {
    let t = test_dir("clean");
    let out = t.path().join("out");
    let mut c = client(out.clone(), None);
    c.save_blocking(request("step_1", 1)).expect("1");
    c.save_blocking(request("step_3", 3)).expect("3");
    drop(c);
    // A crashed save of step_2 (no metadata).
    let partial = out.join(".tmp-step_2-999");
    fs::create_dir_all(partial.join("optim")).expect("mkdir");
    fs::write(partial.join("model.safetensors"), b"partial").expect("write");
    // A crash after the metadata was written but before the rename: restored.
    let finished = out.join(".tmp-step_3-999");
    fs::rename(out.join("step_3"), &finished).expect("mv");
    // A replaced copy whose new version is in place: removed.
    let old = out.join(".tmp-step_1-999.old");
    fs::create_dir_all(&old).expect("mkdir");
    // Unrelated things are left alone.
    fs::create_dir_all(out.join(".tmp-notours")).expect("mkdir");
    fs::create_dir_all(out.join("logs")).expect("mkdir");

    let mut cleaned = clean_partial(&out).expect("clean");
    cleaned.sort_by(|a, b| a.path.cmp(&b.path));
    assert_eq!(
        cleaned,
        vec![
            CleanedDir {
                path: old.clone(),
                action: CleanAction::Removed
            },
            CleanedDir {
                path: partial.clone(),
                action: CleanAction::Removed
            },
            CleanedDir {
                path: finished.clone(),
                action: CleanAction::Restored {
                    to: out.join("step_3")
                }
            },
        ]
    );
    assert!(!partial.exists() && !old.exists() && !finished.exists());
    verify(&out.join("step_1"), true).expect("step_1 kept");
    verify(&out.join("step_3"), true).expect("step_3 restored");
    assert!(out.join(".tmp-notours").exists() && out.join("logs").exists());
    assert_eq!(clean_partial(&out).expect("again"), vec![]);
    assert_eq!(
        clean_partial(&t.path().join("missing")).expect("missing"),
        vec![]
    );
}

#[test]
fn saving_the_same_name_twice_replaces_it_atomically() {
    let t = test_dir("replace");
    let out = t.path().join("out");
    let mut c = client(out.clone(), None);
    c.save_blocking(request("step_5", 5)).expect("first");
    let dir = out.join("step_5");
    let first = fs::read(dir.join("model.safetensors")).expect("read");

    let (started_tx, started) = mpsc::channel();
    let (go, go_rx) = mpsc::channel::<()>();
    let mut m = meta(5);
    m.extra = serde_json::json!({ "attempt": 2 });
    c.save(SaveRequest::new("step_5", m, move |d: &Path| {
        let _ = started_tx.send(());
        let _ = go_rx.recv();
        fs::write(d.join("model.safetensors"), b"second attempt").map_err(WriteError::from)
    }))
    .expect("second");
    started
        .recv_timeout(Duration::from_secs(30))
        .expect("started");
    // While the second save runs, the first copy is still there and complete.
    assert_eq!(
        verify(&dir, true).expect("old complete").meta.extra,
        meta(5).extra
    );
    assert_eq!(
        fs::read(dir.join("model.safetensors")).expect("read"),
        first
    );
    let _ = go.send(());
    let published = c.wait().expect("wait").expect("published");
    assert_eq!(published.dir, dir);
    let manifest = verify(&dir, true).expect("new complete");
    assert_eq!(manifest.meta.extra, serde_json::json!({ "attempt": 2 }));
    assert_eq!(
        manifest.files.len(),
        1,
        "no stale files from the first copy"
    );
    assert_eq!(
        fs::read(dir.join("model.safetensors")).expect("read"),
        b"second attempt"
    );
    assert!(temp_dirs(&out).is_empty(), "{:?}", temp_dirs(&out));
}

#[test]
fn drop_waits_for_the_in_flight_save() {
    let t = test_dir("drop");
    let out = t.path().join("out");
    let mut c = client(out.clone(), None);
    let (req, gate) = gated_request("epoch_0", 100);
    c.save(req).expect("save");
    gate.wait_started();
    gate.release();
    drop(c);
    let m = verify(&out.join("epoch_0"), true).expect("published before drop returned");
    assert_eq!(m.meta.step, 100);
}

#[test]
fn invalid_requests_are_rejected_up_front() {
    let t = test_dir("invalid");
    let out = t.path().join("out");
    let mut c = client(out.clone(), None);
    for bad in [
        "../escape",
        "step_",
        "step_01",
        "final",
        "step_1/x",
        ".tmp-step_1-3",
    ] {
        let err = c.save(request(bad, 1)).expect_err(bad);
        assert!(
            matches!(err, ClientError::InvalidName { .. }),
            "{bad}: {err:?}"
        );
        assert!(err.to_string().contains("step_<N>"));
    }
    assert!(!c.is_saving());
    assert!(fs::read_dir(&out).expect("read").next().is_none());
    let err = CheckpointClient::new(
        out.clone(),
        ClientOptions {
            keep_last_n: Some(0),
        },
    )
    .err()
    .expect("keep 0");
    assert!(err.to_string().contains("keep_last_n"));

    // The writer may not create the metadata file itself.
    let err = c
        .save_blocking(SaveRequest::new("step_1", meta(1), |d: &Path| {
            fs::write(d.join(METADATA_FILE), b"{}").map_err(WriteError::from)
        }))
        .expect_err("reserved");
    assert!(err.to_string().contains("reserved"), "{err}");
    assert!(temp_dirs(&out).is_empty());
}

#[test]
fn human_sizes() {
    assert_eq!(human_size(0), "0 B");
    assert_eq!(human_size(1023), "1023 B");
    assert_eq!(human_size(1536), "1.5 KiB");
    assert_eq!(human_size(5 * 1024 * 1024 * 1024), "5.0 GiB");
    assert_eq!(format_report(&[]), "no checkpoints found\n");
}

#[test]
fn name_parsing() {
    assert_eq!(
        CheckpointName::parse("step_120"),
        Some(CheckpointName {
            kind: NameKind::Step,
            number: 120
        })
    );
    assert_eq!(
        CheckpointName::parse("epoch_0").map(|n| n.to_string()),
        Some("epoch_0".into())
    );
    assert_eq!(CheckpointName::parse("step_-1"), None);
    assert_eq!(CheckpointName::parse("step_99999999999999999999999"), None);
    let t = meta::parse_temp_name(".tmp-step_3-42.old").expect("temp");
    assert_eq!((t.target.as_str(), t.old), ("step_3", true));
    assert_eq!(meta::parse_temp_name(".tmp-step_3"), None);
}
