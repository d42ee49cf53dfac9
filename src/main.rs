//! The `tune` binary: parses the command line, runs commands, renders errors as one line
//! plus causes (exit 2 for bad input, 1 for a failed run), never a panic trace.

use std::process::ExitCode;

use anyhow::anyhow;
use clap::Parser;

use tune::cli::{CheckpointsAction, Cli, CliError, Command, commands};
use tune::config::RecipeConfig;
use tune::config::schema::Device;
use tune::distributed::launch::{LaunchError, LaunchPlan, run_workers};
use tune::distributed::{WorkerError, World};
use tune::training::activation_checkpointing::Checkpointing;

// A training step allocates and frees the same activation buffers every time. mimalloc
// reuses them from thread-local pages instead of going back to glibc's arenas and the
// kernel: 1.4-1.6x the tokens/s of the tiny LoRA benchmark (see BENCHMARKS.md). Training
// also tells it to keep freed pages mapped (tune::training::memory). When memory runs out,
// the process ends with an error naming the limit and the ways out (tune::out_of_memory).
#[global_allocator]
static GLOBAL: tune::out_of_memory::Allocator = tune::out_of_memory::Allocator;

/// Linux's default main-thread stack (`ulimit -s`: 8 MiB).
const MAIN_STACK_BYTES: usize = 8 << 20;

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Library logs (burn-collective's) go to stderr, warnings and errors unless TUNE_LOG asks
    // for more (error, warn, info, debug, trace); stdout stays the command's own output.
    let level = std::env::var("TUNE_LOG")
        .ok()
        .and_then(|l| l.parse().ok())
        .unwrap_or(tracing_subscriber::filter::LevelFilter::WARN);
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(level)
        .try_init();
    // A CPU job runs on a pool thread (`kernels::on_pool`): give those threads the main
    // thread's 8 MiB stack rather than the 2 MiB a spawned thread gets.
    let _ = rayon::ThreadPoolBuilder::new()
        .stack_size(MAIN_STACK_BYTES)
        .build_global();
    match dispatch(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{}", e.render());
            ExitCode::from(e.exit_code())
        }
    }
}

fn dispatch(command: Command) -> Result<(), CliError> {
    // Not locked for the whole command: a run's background threads (burn-collective's
    // servers) may write too.
    let mut out = std::io::stdout();
    match command {
        Command::Ls => commands::ls(&mut out).map_err(CliError::failed),
        Command::Cat { config } => commands::cat(&config, &mut out),
        Command::Cp {
            config,
            destination,
            no_clobber,
            make_parents,
        } => {
            let target = commands::cp(&config, &destination, no_clobber, make_parents)?;
            eprintln!("Copied {config} to {}", target.display());
            Ok(())
        }
        Command::Validate {
            explain: Some(key),
            recipe,
            ..
        } => commands::explain(&key, recipe.as_deref(), &mut out),
        Command::Validate {
            config,
            overrides,
            recipe,
            explain: None,
        } => match config {
            Some(config) => {
                commands::validate_cmd(&config, &overrides, recipe.as_deref(), &mut out)
            }
            None => Err(CliError::bad(anyhow!(
                "tune validate needs a CONFIG (or --explain KEY)"
            ))),
        },
        Command::Checkpoints {
            action: Some(CheckpointsAction::Consolidate { dir }),
            ..
        } => commands::consolidate(&dir, &mut out),
        Command::Checkpoints {
            action: None,
            output_dir,
            no_verify,
        } => match output_dir {
            Some(dir) => commands::checkpoints(&dir, !no_verify, &mut out),
            None => Err(CliError::bad(anyhow!(
                "tune checkpoints needs an OUTPUT_DIR (or the consolidate subcommand)"
            ))),
        },
        Command::Rendezvous { port } => {
            tune::distributed::launch::serve_rendezvous(port);
            Ok(())
        }
        Command::Run {
            nproc_per_node,
            nnodes,
            node_rank,
            rdzv_endpoint,
            rdzv_timeout,
            recipe,
            config,
            overrides,
        } => {
            let launch = LaunchPlan {
                nproc_per_node,
                nnodes,
                node_rank,
                rdzv_endpoint,
                rdzv_timeout: std::time::Duration::from_secs(rdzv_timeout),
            };
            run(&launch, &recipe, &config, &overrides)
        }
        Command::Bench {
            shape,
            mode,
            batch_size,
            seq_len,
            steps,
            lora_rank,
            activation_checkpointing,
            activation_offloading,
            dtype,
            output_chunks,
            attention,
            attention_block,
            row_lengths,
            keep_padding,
            device,
            json,
        } => {
            let row_lengths = row_lengths
                .map(|path| tune::bench::read_row_lengths(&path))
                .transpose()
                .map_err(CliError::bad)?;
            let settings = tune::bench::BenchSettings {
                shape,
                mode,
                batch_size,
                seq_len,
                steps,
                lora_rank,
                checkpointing: match (activation_checkpointing, activation_offloading) {
                    (true, true) => Checkpointing::LayersOffloaded,
                    (checkpointing, _) => Checkpointing::layers_if(checkpointing),
                },
                dtype: dtype.into(),
                output_chunks,
                attention,
                attention_block: attention_block.map(usize::from),
                row_lengths,
                keep_padding,
            };
            bench(&settings, device, json)
        }
        Command::Download {
            repo_id,
            output_dir,
            ignore_patterns,
            revision,
            hf_token,
            repo_type,
        } => commands::download(
            repo_id,
            output_dir,
            ignore_patterns,
            revision,
            hf_token,
            repo_type,
            &mut out,
        ),
        Command::Push {
            dir,
            repo_id,
            private,
            revision,
            commit_message,
            create_pr,
            hf_token,
            include_training_state,
            dry_run,
        } => {
            let opts = tune::hub::PushOptions {
                dir,
                repo_id,
                private,
                revision,
                commit_message,
                create_pr,
                token: hf_token,
                include_training_state,
                progress: true,
                ..Default::default()
            };
            if dry_run {
                commands::push_dry_run(&opts, &mut out)
            } else {
                commands::push(opts, &mut out)
            }
        }
        Command::Plot {
            metrics,
            output,
            width,
            height,
        } => {
            let curves = tune::plot::read_metrics(&metrics).map_err(CliError::bad)?;
            tune::plot::plot(&curves, &output, (width, height)).map_err(|e| match e {
                tune::plot::PlotError::UnknownFormat { .. } => CliError::bad(e),
                other => CliError::failed(other),
            })?;
            let rewards = match curves.rewards.len() {
                0 => String::new(),
                n => format!(", {n} reward points"),
            };
            eprintln!(
                "Wrote {} ({} loss points, {} lr points, {} validation points{rewards})",
                output.display(),
                curves.loss.len(),
                curves.lr.len(),
                curves.val_loss.len()
            );
            Ok(())
        }
        Command::Quantize {
            config,
            overrides,
            recipe,
        } => {
            let dir = tune::cli::quantize::quantize(&config, &overrides, recipe.as_deref())?;
            eprintln!("Wrote the quantized export to {}", dir.display());
            Ok(())
        }
    }
}

fn run(
    launch: &LaunchPlan,
    recipe: &str,
    config: &str,
    overrides: &[String],
) -> Result<(), CliError> {
    let (typed, resolved) = commands::resolve(recipe, config, overrides)?;
    let distributed = tune::recipes::is_distributed_name(recipe);
    let recipe_kind = typed.recipe;
    if launch.is_distributed() && !distributed {
        // torchtune refuses the same way: only its *_distributed scripts take torchrun flags.
        return Err(CliError::bad(match recipe_kind.distributed {
            Some(name) => {
                anyhow!("{recipe} runs on one device; with --nproc_per_node or --nnodes use {name}")
            }
            None => anyhow!(
                "{recipe} does not support distributed runs; run it without --nproc_per_node and --nnodes"
            ),
        }));
    }
    if typed.as_train().is_some() {
        // SIGINT/SIGTERM stop training at the next step boundary (a second one exits at once).
        tune::interrupt::install().map_err(CliError::failed)?;
    }
    let started = launch.start().map_err(CliError::bad)?;
    let worlds = started.worlds.clone();
    let single_worker = worlds.len() == 1;
    let device = typed.device();
    let base_dir = std::env::current_dir().map_err(CliError::failed)?;
    let job = std::sync::Arc::new(Job {
        typed,
        yaml: resolved.to_yaml_string(),
        base_dir,
        recipe_name: recipe_kind.script_name(distributed),
    });
    if launch.is_distributed() {
        eprintln!(
            "Launching {} with {} workers ({} on this node, node {} of {})",
            job.recipe_name,
            launch.world_size(),
            launch.nproc_per_node,
            launch.node_rank,
            launch.nnodes
        );
    }
    let outcome = match Device::or_default(device) {
        Device::Cpu => {
            let run = move || {
                run_workers(worlds, move |world| {
                    job.run::<burn::backend::Autodiff<burn::backend::Flex>>(
                        Default::default(),
                        world,
                    )
                })
            };
            // Workers in threads wait for each other in collectives: only a lone worker may
            // take a pool thread (more workers than pool threads would never all start).
            if single_worker {
                tune::kernels::on_pool(run)
            } else {
                run()
            }
        }
        Device::Cuda => run_cuda(job, worlds)?,
        Device::Wgpu => run_wgpu(job, worlds)?,
    };
    let stopped = match &outcome {
        Err(LaunchError::Worker { error, .. }) => error.stop_signal(),
        _ => None,
    };
    if outcome.is_ok() || stopped.is_some() {
        started.done();
    }
    if let (Some(signal), Err(LaunchError::Worker { error, .. })) = (stopped, &outcome) {
        // An orderly stop, reported as the stop itself, whichever worker's it is.
        return Err(CliError::Stopped(anyhow!("{error}"), signal.exit_code()));
    }
    let outcome = outcome.map_err(|e| if launch.nnodes > 1 { e.explained() } else { e });
    outcome.map_err(|e| match e {
        // One worker: its own error, as a single-device run reports it.
        LaunchError::Worker { error, .. } if !launch.is_distributed() => CliError::failed(error),
        other => CliError::failed(other),
    })
}

/// What every worker of a run needs: the validated config and where it came from.
struct Job {
    typed: RecipeConfig,
    yaml: String,
    base_dir: std::path::PathBuf,
    recipe_name: &'static str,
}

impl Job {
    fn run<B: burn::tensor::backend::AutodiffBackend>(
        &self,
        device: B::Device,
        world: World,
    ) -> Result<(), WorkerError> {
        // Before the model goes to the device: a failure there from the load on is caught.
        tune::device::watch_device_faults();
        let ctx = tune::recipes::RunContext::<B> {
            recipe_name: self.recipe_name,
            device,
            resolved_yaml: self.yaml.clone(),
            base_dir: self.base_dir.clone(),
            world,
        };
        tune::recipes::run(&self.typed, &ctx)
    }
}

#[cfg(feature = "cuda")]
fn run_cuda(
    job: std::sync::Arc<Job>,
    worlds: Vec<World>,
) -> Result<Result<(), LaunchError>, CliError> {
    type B = burn::backend::Autodiff<burn::backend::Cuda>;
    Ok(run_workers(worlds, move |world| {
        // One CUDA device per worker of this node: its local rank.
        let device = burn::backend::cuda::CudaDevice::new(world.rank % world.local_size);
        job.run::<B>(device, world)
    }))
}

#[cfg(not(feature = "cuda"))]
fn run_cuda(_: std::sync::Arc<Job>, _: Vec<World>) -> Result<Result<(), LaunchError>, CliError> {
    Err(CliError::bad(anyhow!(
        "device: cuda, but this tune was built without CUDA support; rebuild with `cargo install --path . --features cuda` (or set device=cpu)"
    )))
}

#[cfg(feature = "wgpu")]
fn run_wgpu(
    job: std::sync::Arc<Job>,
    worlds: Vec<World>,
) -> Result<Result<(), LaunchError>, CliError> {
    type B = burn::backend::Autodiff<burn::backend::Wgpu>;
    if worlds.len() > 1 {
        // cubecl's default device is one adapter: several workers would share it, which is
        // slower than one, never faster.
        return Err(CliError::bad(anyhow!(
            "device: wgpu runs one worker per node (it uses the platform's default adapter); drop --nproc_per_node, or use device=cuda for several GPUs"
        )));
    }
    let adapter = tune::device::wgpu_adapter().map_err(CliError::bad)?;
    eprintln!("device: wgpu on {adapter}");
    Ok(run_workers(worlds, move |world| {
        job.run::<B>(burn::backend::wgpu::WgpuDevice::DefaultDevice, world)
    }))
}

#[cfg(not(feature = "wgpu"))]
fn run_wgpu(_: std::sync::Arc<Job>, _: Vec<World>) -> Result<Result<(), LaunchError>, CliError> {
    Err(CliError::bad(tune::device::DeviceError::WgpuNotBuilt))
}

fn bench(
    settings: &tune::bench::BenchSettings,
    device: Device,
    json: bool,
) -> Result<(), CliError> {
    if settings.attention_block.is_some() && matches!(device, Device::Cpu) {
        return Err(CliError::bad(anyhow!(
            "--attention-block caps the block of tune's cubecl attention kernels: it applies with --device cuda or wgpu, not cpu (drop it there)"
        )));
    }
    let scratch = std::env::temp_dir();
    tune::device::watch_device_faults();
    let report = match device {
        Device::Cpu => tune::kernels::on_pool(|| {
            tune::bench::run::<burn::backend::Autodiff<burn::backend::Flex>>(
                settings,
                &Default::default(),
                &scratch,
            )
        }),
        #[cfg(feature = "cuda")]
        Device::Cuda => tune::bench::run::<burn::backend::Autodiff<burn::backend::Cuda>>(
            settings,
            &Default::default(),
            &scratch,
        ),
        #[cfg(feature = "wgpu")]
        Device::Wgpu => {
            let adapter = tune::device::wgpu_adapter().map_err(CliError::bad)?;
            eprintln!("device: wgpu on {adapter}");
            if adapter.software {
                eprintln!(
                    "note: {} renders in software on the CPU: these figures check that the GPU code path runs, they are not GPU performance",
                    adapter.name
                );
            }
            tune::bench::run::<burn::backend::Autodiff<burn::backend::Wgpu>>(
                settings,
                &Default::default(),
                &scratch,
            )
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda => {
            return Err(CliError::bad(anyhow!(
                "--device cuda: this tune was built without CUDA support; rebuild with `cargo install --path . --features cuda` (or use --device cpu)"
            )));
        }
        #[cfg(not(feature = "wgpu"))]
        Device::Wgpu => return Err(CliError::bad(tune::device::DeviceError::WgpuNotBuilt)),
    }
    .map_err(|e| match e {
        tune::bench::BenchError::UnknownShape(_) => CliError::bad(e),
        other => CliError::failed(other),
    })?;
    if json {
        println!("{}", report.to_json(settings));
    } else {
        println!("{}", report.to_markdown(settings));
    }
    Ok(())
}
