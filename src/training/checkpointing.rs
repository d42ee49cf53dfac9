//! What a training run saves, and resuming from it. The recipe says *what* (a PEFT adapter,
//! optionally a merged model; or a full model); this module snapshots it to host memory and
//! hands the writing to the run's one [`CheckpointClient`], which publishes it atomically in
//! the background.
//!
//! A checkpoint directory (`step_N/` or `epoch_N/` under `output_dir`) holds:
//! - `adapter_model.safetensors` + `adapter_config.json` (LoRA), loadable by peft;
//! - `model*.safetensors` (+ index) + `config.json` + tokenizer files (full, or merged LoRA),
//!   loadable by transformers;
//! - `quantized/` (QAT runs, final checkpoint): the int4 export, see `model_io::quantized`;
//! - `optimizer.safetensors`: optimizer moments by parameter name;
//! - `tune_checkpoint.json`: the client's metadata (format version, files and checksums),
//!   whose `extra` carries the [`TrainState`] and the config fingerprint used on resume.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::tensor::backend::AutodiffBackend;
use serde::{Deserialize, Serialize};

use super::error::{CheckpointingError, Divergence, MAX_WEIGHT, TrainError};
use super::parallel::optimizer_shards::{SHARD_TIMEOUT, assemble, checkpoint_name, read_state};
use super::parallel::sharded_checkpoint::{
    RankShare, SHARE_TIMEOUT, collect_into, consolidates, read_optimizer_state,
    staging_dir as sharded_staging_dir, write_share,
};
use super::save_hook::{OptimizerSnapshot, SaveHook, SaveKind, TrainState};
use crate::checkpoint::safetensors_io::write_file;
use crate::checkpoint::{HostTensor, StorageDtype};
use crate::checkpoint_client::{
    CheckpointClient, CheckpointMeta, ClientOptions, PublishedCheckpoint, SaveRequest, WriteError,
    WriterFn, clean_partial, latest_complete, latest_verified,
};
use crate::model_io::hf::{save_hf_companions, save_hf_dir};
use crate::model_io::peft::{AdapterConfig, saved_adapter_state, write_adapter};
use crate::model_io::quantized::{QUANTIZED_DIR, quantize_state, write_quantized};
use crate::models::CausalLm;
use crate::modules::fake_quant::QuantScheme;

pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";

/// What the recipe saves.
#[derive(Debug, Clone)]
pub enum SaveContent {
    /// LoRA: the PEFT adapter; with `merged_model`, also the base with adapters folded in.
    Adapter {
        config: AdapterConfig,
        merged_model: bool,
    },
    /// Full fine-tuning: the whole model in Hugging Face layout.
    FullModel,
}

/// The parts of the config a resumed run must share with the checkpoint (the keys the config
/// declares part of it: model, data, batching, ...), one entry per key; logging and step
/// limits may change. Saved as one JSON object.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunFingerprint {
    /// Dotted key -> value.
    pub entries: serde_json::Map<String, serde_json::Value>,
    /// The keys a resume may change (lowering the learning rate is how a diverged run
    /// continues from its last healthy checkpoint). Not saved: the current run says.
    pub resume_may_change: Vec<String>,
    /// The declared defaults of this run's keys (`dataset.*.packed` for a list's items). Not
    /// saved: a checkpoint that holds no value for a key, or null, had its default.
    pub defaults: serde_json::Map<String, serde_json::Value>,
}

impl Serialize for RunFingerprint {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.entries.serialize(s)
    }
}

impl<'de> Deserialize<'de> for RunFingerprint {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(Self {
            entries: serde_json::Map::deserialize(d)?,
            ..Self::default()
        })
    }
}

impl RunFingerprint {
    /// One entry per key: nested objects flattened to dotted keys (checkpoints written before
    /// fingerprints had one entry per key held whole sections, `{"model": {...}}`).
    fn flat(&self) -> BTreeMap<String, &serde_json::Value> {
        fn walk<'a>(
            prefix: &str,
            value: &'a serde_json::Value,
            out: &mut BTreeMap<String, &'a serde_json::Value>,
        ) {
            match value {
                serde_json::Value::Object(map) => {
                    for (k, v) in map {
                        walk(&format!("{prefix}.{k}"), v, out);
                    }
                }
                leaf => {
                    out.insert(prefix.to_string(), leaf);
                }
            }
        }
        let mut out = BTreeMap::new();
        for (k, v) in &self.entries {
            walk(k, v, &mut out);
        }
        out
    }

    /// The keys of `current` (this run's fingerprint) whose value differs from the one this
    /// (saved) fingerprint holds, for the "what changed" message. Only `current`'s keys
    /// count: a key the checkpoint holds and this run does not is one the config no longer has
    /// (a setting of another loss, a LoRA key of a full builder, a key tune dropped), and
    /// `_component_` says when the component changed. A key the checkpoint holds no value for
    /// (it was added, or was optional, after the checkpoint was written) had its declared
    /// default. Lists of sections (datasets, reward functions) compare item by item so.
    pub fn differences(&self, current: &RunFingerprint) -> Vec<String> {
        let (saved, ours) = (self.flat(), current.flat());
        let null = serde_json::Value::Null;
        ours.iter()
            .filter(|(key, value)| {
                let theirs = saved.get(*key).copied().unwrap_or(&null);
                !same(theirs, value, key, &current.defaults)
            })
            .map(|(key, _)| key.clone())
            .collect()
    }

    pub fn hash(&self) -> String {
        use sha2::{Digest, Sha256};
        let text = serde_json::to_string(&self.flat()).unwrap_or_default();
        format!("{:x}", Sha256::digest(text.as_bytes()))[..16].to_string()
    }

    /// An entry's value (a flattened key), for messages.
    pub fn get(&self, key: &str) -> serde_json::Value {
        self.flat()
            .get(key)
            .map_or(serde_json::Value::Null, |v| (*v).clone())
    }
}

/// Whether a saved value is the current one: the same JSON, or none (null) where the key's
/// declared default is the current value; objects compare on the current one's keys, lists of
/// the same length item by item (defaults under `key.*`).
fn same(
    saved: &serde_json::Value,
    current: &serde_json::Value,
    key: &str,
    defaults: &serde_json::Map<String, serde_json::Value>,
) -> bool {
    use serde_json::Value;
    match (saved, current) {
        (Value::Object(theirs), Value::Object(ours)) => ours.iter().all(|(k, v)| {
            same(
                theirs.get(k).unwrap_or(&Value::Null),
                v,
                &format!("{key}.{k}"),
                defaults,
            )
        }),
        (Value::Array(theirs), Value::Array(ours)) if theirs.len() == ours.len() => theirs
            .iter()
            .zip(ours)
            .all(|(t, o)| same(t, o, &format!("{key}.*"), defaults)),
        (Value::Null, ours) => ours.is_null() || defaults.get(key) == Some(ours),
        (theirs, ours) => theirs == ours,
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct ResumeInfo {
    state: TrainState,
    optimizer_step: u64,
    fingerprint: RunFingerprint,
    /// Files the optimizer state is split into (one per rank of a ZeRO-1 run, see
    /// `optimizer_shards`); 1 is `optimizer.safetensors`.
    #[serde(default = "one")]
    optimizer_shards: usize,
    /// Data-parallel workers of the run that wrote it (a resume may use another number).
    #[serde(default = "one")]
    world_size: usize,
    /// Every rank wrote its share of the optimizer state into `optimizer_sharded/`
    /// (an FSDP run's sharded checkpoint, see `sharded_checkpoint`).
    #[serde(default)]
    optimizer_sharded: bool,
}

fn one() -> usize {
    1
}

pub struct RunCheckpointer {
    client: CheckpointClient,
    recipe: String,
    content: SaveContent,
    fingerprint: RunFingerprint,
    /// Where tokenizer and generation files are copied from.
    source_dir: PathBuf,
    storage_dtype: StorageDtype,
    max_shard_bytes: usize,
    layout: SaveLayout,
    pub last_published: Option<PublishedCheckpoint>,
    output_dir: PathBuf,
}

/// How a run's checkpoints are laid out besides what they hold: decided once, with the run's
/// parallelism (`parallel::Saves`), and fixed for the run.
#[derive(Debug, Clone, Copy, Default)]
pub struct SaveLayout {
    /// Data-parallel workers of the run, recorded in every checkpoint.
    pub world_size: usize,
    /// ZeRO-1 with a shared output directory: every rank writes its optimizer shard and this
    /// (rank 0's) writer gathers them into the checkpoint (`optimizer_shards`).
    pub optimizer_shards: Option<usize>,
    /// FSDP with an output directory every rank sees: every rank writes its share of each
    /// checkpoint (`sharded_checkpoint`); this writer moves the others' in.
    pub sharded: Option<ShardedRun>,
    /// QAT: the final checkpoint also holds the int4 export in `quantized/` (adapters merged).
    pub quantized_export: Option<QuantScheme>,
    /// Every save is published before `save` returns (PPO's value model: its checkpoint is
    /// then durable before the policy's of the same step is even requested, so a published
    /// policy checkpoint always has its value model's beside it).
    pub always_block: bool,
}

/// A run whose ranks write their own shares of each checkpoint.
#[derive(Debug, Clone, Copy)]
pub struct ShardedRun {
    /// The number every rank names the run's staging directories with.
    pub id: u64,
    pub world: usize,
}

/// What a run's checkpoint client writes and where.
pub struct CheckpointerOptions {
    pub output_dir: PathBuf,
    pub keep_last_n: Option<usize>,
    /// torchtune's script name, recorded in every checkpoint.
    pub recipe: String,
    pub content: SaveContent,
    pub fingerprint: RunFingerprint,
    /// Where tokenizer and generation files are copied from.
    pub source_dir: PathBuf,
    pub storage_dtype: StorageDtype,
    pub max_shard_bytes: usize,
    pub layout: SaveLayout,
}

impl RunCheckpointer {
    pub fn new(options: CheckpointerOptions) -> Result<Self, TrainError> {
        let CheckpointerOptions {
            output_dir,
            keep_last_n,
            recipe,
            content,
            fingerprint,
            source_dir,
            storage_dtype,
            max_shard_bytes,
            layout,
        } = options;
        let client = CheckpointClient::new(output_dir.clone(), ClientOptions { keep_last_n })
            .map_err(CheckpointingError::from)?;
        Ok(Self {
            client,
            recipe,
            content,
            fingerprint,
            source_dir,
            storage_dtype,
            max_shard_bytes,
            layout: SaveLayout {
                world_size: layout.world_size.max(1),
                ..layout
            },
            last_published: None,
            output_dir,
        })
    }

    /// The newest complete checkpoint of the output directory: this run's last published one,
    /// else one an earlier run left (the one a resumed run started from).
    pub fn last_complete_dir(&self) -> Option<PathBuf> {
        self.last_published
            .as_ref()
            .map(|p| p.dir.clone())
            .or_else(|| {
                latest_complete(&self.output_dir)
                    .ok()
                    .flatten()
                    .map(|p| p.dir)
            })
    }

    /// Waits for a background save still in flight (call before exiting).
    pub fn finish(&mut self) -> Result<(), TrainError> {
        if let Some(p) = self.client.wait().map_err(CheckpointingError::from)? {
            self.last_published = Some(p);
        }
        Ok(())
    }
}

impl RunCheckpointer {
    /// The writer of a checkpoint rank 0 saves alone: the adapter and/or the whole model, the
    /// optimizer state (gathered, or each rank's file moved in), the int4 export.
    fn whole_writer<B: AutodiffBackend>(
        &self,
        kind: SaveKind,
        model: &mut CausalLm<B>,
        optimizer: &OptimizerSnapshot,
        state: &TrainState,
        name: &str,
    ) -> Result<WriterFn, TrainError> {
        let adapter = match &self.content {
            SaveContent::Adapter { config, .. } => {
                Some((saved_adapter_state(model, config), config.clone()))
            }
            SaveContent::FullModel => None,
        };
        let full = match &self.content {
            SaveContent::Adapter {
                merged_model: true, ..
            } if kind == SaveKind::Final || kind == SaveKind::EpochEnd => {
                Some(model.merged_hf_state_dict())
            }
            SaveContent::Adapter { .. } => None,
            SaveContent::FullModel => Some(model.hf_state_dict()),
        };
        // Quantizing needs the model's device, so it happens in the blocking part too.
        let quantized = match self.layout.quantized_export {
            Some(scheme) if kind == SaveKind::Final => {
                let group_size = scheme
                    .group_size()
                    .ok_or(CheckpointingError::NoQuantizedWeights)?;
                let state = model.merged_hf_state_dict();
                let tensors = quantize_state::<B>(&state, group_size, &model.device())
                    .map_err(CheckpointingError::from)?;
                Some((tensors, scheme, group_size))
            }
            _ => None,
        };
        // Never publish weights that diverged: the checkpoint before stays the last one.
        let trained = adapter.iter().map(|(t, _)| t).chain(full.iter());
        if let Some(cause) = trained.flat_map(|t| unhealthy_weight(t)).next() {
            return Err(TrainError::Diverged {
                cause,
                step: state.global_step,
                epoch: state.epoch,
            });
        }
        let optimizer_state = optimizer.state.clone();
        let model_args = model.args.clone();
        let config_json = model.args.raw.clone();
        let (source_dir, dtype, shard) = (
            self.source_dir.clone(),
            self.storage_dtype,
            self.max_shard_bytes,
        );
        let (shards, output_dir, checkpoint) = (
            self.layout.optimizer_shards,
            self.output_dir.clone(),
            name.to_string(),
        );
        Ok(Box::new(move |dir: &Path| -> Result<(), WriteError> {
            let fail = |e: crate::checkpoint::CheckpointError| WriteError::Other(Box::new(e));
            if let Some((tensors, config)) = adapter {
                write_adapter(dir, &tensors, &config).map_err(fail)?;
            }
            if let Some(state) = full {
                save_hf_dir(dir, &state, &model_args, dtype, shard, Some(&source_dir))
                    .map_err(fail)?;
            }
            if let Some((tensors, scheme, group_size)) = quantized {
                let qdir = dir.join(QUANTIZED_DIR);
                write_quantized(
                    &qdir,
                    &tensors,
                    &config_json,
                    scheme,
                    group_size,
                    dtype,
                    Some(&source_dir),
                )
                .map_err(fail)?;
            }
            match shards {
                Some(world) => assemble(
                    dir,
                    &output_dir,
                    &checkpoint,
                    world,
                    &optimizer_state,
                    SHARD_TIMEOUT,
                )?,
                None => write_file(
                    &dir.join(OPTIMIZER_FILE),
                    &optimizer_state,
                    StorageDtype::F32,
                )
                .map_err(fail)?,
            }
            Ok(())
        }))
    }

    /// The writer of a checkpoint every rank writes its share of (`sharded_checkpoint`): rank
    /// 0's share, every other rank's moved in, consolidated at epoch ends; `config.json` and
    /// the tokenizer files beside them. The trainer checked every rank's weights are healthy.
    fn sharded_writer<B: AutodiffBackend>(
        &self,
        kind: SaveKind,
        model: &CausalLm<B>,
        optimizer: &OptimizerSnapshot,
        name: &str,
        run: ShardedRun,
    ) -> Result<WriterFn, TrainError> {
        let share = RankShare::new(
            model,
            &optimizer.state,
            run.world,
            self.storage_dtype,
            self.max_shard_bytes,
        )
        .map_err(CheckpointingError::from)?;
        let staging = sharded_staging_dir(&self.output_dir, name, run.id);
        let consolidate = consolidates(kind);
        let config_json = model.args.raw.clone();
        let (source_dir, dtype) = (self.source_dir.clone(), self.storage_dtype);
        Ok(Box::new(move |dir: &Path| -> Result<(), WriteError> {
            write_share(&staging, &share, consolidate, SHARE_TIMEOUT)?;
            collect_into(dir, &staging, run.world, consolidate, SHARE_TIMEOUT)?;
            save_hf_companions(dir, &config_json, dtype, Some(&source_dir))
                .map_err(|e| WriteError::Other(Box::new(e)))?;
            Ok(())
        }))
    }
}

impl<B: AutodiffBackend> SaveHook<B> for RunCheckpointer {
    fn save(
        &mut self,
        kind: SaveKind,
        model: &mut CausalLm<B>,
        optimizer: &OptimizerSnapshot,
        state: &TrainState,
    ) -> Result<(), TrainError> {
        // Everything up to the request is the blocking part: copying state to the host.
        let started = std::time::Instant::now();
        let name = checkpoint_name(kind, state);
        let writer = match self.layout.sharded {
            Some(run) => self.sharded_writer(kind, model, optimizer, &name, run)?,
            None => self.whole_writer(kind, model, optimizer, state, &name)?,
        };
        let snapshot_time = started.elapsed();

        let mut meta = CheckpointMeta::new(
            &self.recipe,
            self.fingerprint.hash(),
            state.global_step as u64,
            state.epoch as u64,
        );
        meta.steps_in_epoch = Some(state.steps_per_epoch as u64);
        let info = ResumeInfo {
            state: state.clone(),
            optimizer_step: optimizer.step,
            fingerprint: self.fingerprint.clone(),
            optimizer_shards: self.layout.optimizer_shards.unwrap_or(1),
            world_size: self.layout.world_size,
            optimizer_sharded: self.layout.sharded.is_some(),
        };
        meta.extra = serde_json::to_value(&info).unwrap_or_default();

        let request = SaveRequest::new(name.clone(), meta, writer);
        let report = if kind.blocks() || self.layout.always_block {
            self.client.save_blocking(request)
        } else {
            self.client.save(request)
        }
        .map_err(CheckpointingError::from)?;
        if report.waited.as_millis() > 0 {
            crate::say!(
                "checkpoint {name}: waited {:.2}s for the previous save to finish",
                report.waited.as_secs_f64()
            );
        }
        if !kind.blocks() {
            crate::say!(
                "checkpoint {name}: training blocked {:.3}s for the snapshot; writing in the background",
                snapshot_time.as_secs_f64()
            );
        }
        if let Some(p) = report.published.or(report.previous) {
            self.last_published = Some(p);
        }
        Ok(())
    }
}

/// The newest complete checkpoint in `output_dir` when it was written by a different run (its
/// fingerprint differs from this one): its directory and the keys that differ. A fresh run into
/// such a directory would mix its checkpoints with the other run's, and a later resume would
/// pick whichever is newest.
pub fn other_run(
    output_dir: &Path,
    fingerprint: &RunFingerprint,
) -> Result<Option<(PathBuf, Vec<String>)>, TrainError> {
    let Some(newest) = latest_complete(output_dir).map_err(CheckpointingError::from)? else {
        return Ok(None);
    };
    let changed = match serde_json::from_value::<ResumeInfo>(newest.meta().extra.clone()) {
        Ok(info) => info.fingerprint.differences(fingerprint),
        Err(_) => vec!["(not a tune training checkpoint)".to_string()],
    };
    Ok((!changed.is_empty()).then_some((newest.dir, changed)))
}

/// `overwrite_output_dir`: removes the published checkpoints of `output_dir` (every `step_N` and
/// `epoch_N` directory with its metadata; nothing else), returning their names.
pub fn remove_checkpoints(output_dir: &Path) -> Result<Vec<String>, TrainError> {
    let entries = match crate::checkpoint_client::list_checkpoints(output_dir) {
        Ok(entries) => entries,
        Err(crate::checkpoint_client::ClientError::OutputDirNotFound { .. }) => return Ok(vec![]),
        Err(e) => return Err(CheckpointingError::from(e).into()),
    };
    let mut removed = Vec::new();
    for entry in entries.into_iter().filter(|e| !e.temporary) {
        std::fs::remove_dir_all(&entry.dir).map_err(|source| {
            CheckpointingError::from(crate::checkpoint_client::ClientError::io(
                "removing",
                entry.dir.clone(),
                source,
            ))
        })?;
        removed.push(entry.name);
    }
    Ok(removed)
}

/// The first weight that is not finite or exceeds [`MAX_WEIGHT`] in magnitude.
fn unhealthy_weight(tensors: &[(String, HostTensor)]) -> Option<Divergence> {
    tensors.iter().find_map(|(name, t)| {
        t.data
            .iter()
            .find(|v| !v.is_finite() || v.abs() > MAX_WEIGHT)
            .map(|&value| Divergence::Weight {
                name: name.clone(),
                value,
            })
    })
}

/// A checkpoint to resume from, checked against the current run.
pub struct Resume {
    pub dir: PathBuf,
    pub state: TrainState,
    pub optimizer_step: u64,
    pub optimizer_state: Vec<(String, HostTensor)>,
}

/// Finds the latest complete checkpoint under `output_dir` that verifies (every recorded file's
/// size and SHA-256) and checks it belongs to this run. A newer one that fails verification is
/// reported and kept, never deleted. With `tidy`, partial directories of a crashed run are
/// removed first (one rank does it).
pub fn find_resume(
    output_dir: &Path,
    fingerprint: &RunFingerprint,
    tidy: bool,
) -> Result<Option<Resume>, TrainError> {
    // Partial directories of a crashed run are never resumed from; tidy them away first.
    let cleaned = if tidy {
        clean_partial(output_dir).map_err(CheckpointingError::from)?
    } else {
        Vec::new()
    };
    for cleaned in cleaned {
        crate::say!(
            "removed the partial checkpoint {} left by an interrupted run",
            cleaned.path.display()
        );
    }
    let Some(newest) = latest_complete(output_dir).map_err(CheckpointingError::from)? else {
        return Ok(None);
    };
    let found = match crate::checkpoint_client::verify(&newest.dir, true) {
        Ok(_) => newest,
        // `latest_verified` says which checkpoints it skips and why; they stay on disk.
        Err(_) => match latest_verified(output_dir).map_err(CheckpointingError::from)? {
            Some(older) => older,
            None => {
                if tidy {
                    crate::say_warn!(
                        "no checkpoint in {} verifies: training starts from the beginning (the damaged ones are kept; `tune checkpoints` lists them)",
                        output_dir.display()
                    );
                }
                return Ok(None);
            }
        },
    };
    resume_of(&found.dir, &found.meta().extra, fingerprint, tidy).map(Some)
}

/// The companion checkpoint `name` in `dir` (PPO's value model's, of the same name as the
/// checkpoint the run resumes from): verified, checked against this run, its optimizer read.
pub fn resume_companion(
    dir: &Path,
    name: &str,
    fingerprint: &RunFingerprint,
) -> Result<Resume, TrainError> {
    let at = dir.join(name);
    let manifest = crate::checkpoint_client::verify(&at, true).map_err(|source| {
        CheckpointingError::MissingCompanion {
            dir: dir.to_path_buf(),
            name: name.to_string(),
            source,
        }
    })?;
    resume_of(&at, &manifest.meta.extra, fingerprint, false)
}

/// The resume point in checkpoint `dir` whose metadata's `extra` is `extra`, if it belongs to
/// this run; `report` says which keys changed that may.
fn resume_of(
    dir: &Path,
    extra: &serde_json::Value,
    fingerprint: &RunFingerprint,
    report: bool,
) -> Result<Resume, TrainError> {
    let info: ResumeInfo =
        serde_json::from_value(extra.clone()).map_err(|source| CheckpointingError::NotTune {
            dir: dir.to_path_buf(),
            source,
        })?;
    let mut changed = info.fingerprint.differences(fingerprint);
    changed.retain(|key| {
        let may_change = fingerprint.resume_may_change.contains(key);
        if may_change && report {
            crate::say!(
                "{key} changed since {} was saved ({} -> {}); resuming with the new value",
                dir.display(),
                info.fingerprint.get(key),
                fingerprint.get(key),
            );
        }
        !may_change
    });
    if !changed.is_empty() {
        return Err(CheckpointingError::ConfigChanged {
            dir: dir.to_path_buf(),
            changed,
        }
        .into());
    }
    let optimizer_state = if info.optimizer_sharded {
        read_optimizer_state(dir)
    } else {
        read_state(dir, OPTIMIZER_FILE, info.optimizer_shards)
    }
    .map_err(CheckpointingError::from)?;
    Ok(Resume {
        dir: dir.to_path_buf(),
        state: info.state,
        optimizer_step: info.optimizer_step,
        optimizer_state,
    })
}
