//! `tune.rewards.command`: a reward computed by any program, in any language.
//!
//! The program is started once per run (not once per batch: a reward that loads a model or a
//! test harness pays that once) with piped stdin, stdout and stderr. For each batch tune writes
//! one JSON object per completion, one per line, on its stdin: `prompt` (the prompt text),
//! `completion` (the decoded completion, special tokens removed) and every other column of the
//! dataset row. The program answers each line, in order, with one line on its stdout: a JSON
//! number, or `null` for "no reward from this function for that completion".
//!
//! Anything else stops the run with a [`CommandError`] naming the command, the completion's JSON
//! line and the tail of the program's stderr: the program exiting, a line that is not a number
//! or `null` (`NaN` and `Infinity` included: one would poison every advantage of its group), no
//! answer within the batch's timeout (the program is then killed), or output before a batch was
//! sent. Never a silent zero: a reward that quietly became 0 would train the policy on noise.
//!
//! The program's stderr is kept (its last 4 KiB) for these messages and not shown otherwise. A
//! program that writes more lines than it was sent makes the protocol ambiguous; the extra line
//! is caught when it arrives before the next batch is sent (the usual case), not after.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Map, Value};

use super::{Completion, Result, RewardFunction, Scores};

pub const COMMAND: &str = "tune.rewards.command";

/// How long a batch may take when the config sets no `timeout`.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// How much of the program's stderr the errors quote (its end).
const STDERR_TAIL: usize = 4096;

/// How much of a completion's JSON line the errors quote.
const ROW_QUOTE: usize = 2000;

/// How long a program may take to exit once its stdin is closed before it is killed.
const EXIT_GRACE: Duration = Duration::from_millis(500);

/// Why the reward command failed. Each names the command; those about one completion carry its
/// JSON line (`row`) and the tail of the program's stderr.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    #[error("reward `{COMMAND}` needs `command: [program, args...]`; the list is empty")]
    Empty,
    #[error("reward command `{command}` could not start: {source}")]
    Spawn {
        command: String,
        source: std::io::Error,
    },
    #[error(
        "reward command `{command}` exited ({status}) before answering completion {index} of the batch\n  row: {row}{}",
        stderr_note(stderr)
    )]
    Exited {
        command: String,
        status: String,
        index: usize,
        row: String,
        stderr: String,
    },
    #[error(
        "reward command `{command}` answered {line:?} for completion {index} of the batch, which is not a number or null (write one JSON number, or null for no reward, per line)\n  row: {row}{}",
        stderr_note(stderr)
    )]
    NotANumber {
        command: String,
        line: String,
        index: usize,
        row: String,
        stderr: String,
    },
    #[error(
        "reward command `{command}` gave no answer for completion {index} of the batch within {seconds} s (the batch's timeout; the program was stopped)\n  row: {row}{}",
        stderr_note(stderr)
    )]
    Timeout {
        command: String,
        seconds: f64,
        index: usize,
        row: String,
        stderr: String,
    },
    #[error(
        "reward command `{command}` wrote {line:?} when no completion was waiting for an answer: it must write exactly one line per line it reads{}",
        stderr_note(stderr)
    )]
    UnexpectedOutput {
        command: String,
        line: String,
        stderr: String,
    },
    #[error("reward command `{command}`: reading its stdout failed: {source}")]
    Read {
        command: String,
        source: std::io::Error,
    },
    #[error("reward command `{command}` failed on an earlier batch of this run")]
    AlreadyFailed { command: String },
}

fn stderr_note(stderr: &str) -> String {
    if stderr.trim().is_empty() {
        "\n  (it wrote nothing on stderr)".into()
    } else {
        format!("\n  its stderr ends with:\n{}", stderr.trim_end())
    }
}

/// The last [`STDERR_TAIL`] bytes a program wrote on stderr, and whether it was closed.
#[derive(Default)]
struct Tail {
    bytes: VecDeque<u8>,
    closed: bool,
}

impl Tail {
    fn push(&mut self, bytes: &[u8]) {
        self.bytes.extend(bytes);
        let extra = self.bytes.len().saturating_sub(STDERR_TAIL);
        self.bytes.drain(..extra);
    }
}

/// The running program: a thread writes batches to its stdin (so a program that stops reading
/// cannot block tune past the timeout), one reads its stdout lines, one keeps its stderr tail.
struct Running {
    child: Child,
    batches: Option<Sender<Vec<u8>>>,
    lines: Receiver<std::io::Result<String>>,
    stderr: Arc<Mutex<Tail>>,
}

impl Running {
    fn start(argv: &[String]) -> std::io::Result<Self> {
        let mut child = Command::new(&argv[0])
            .args(&argv[1..])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        let missing = || std::io::Error::other("the program's pipes were not created");
        let stdin = child.stdin.take().ok_or_else(missing)?;
        let stdout = child.stdout.take().ok_or_else(missing)?;
        let mut stderr_pipe = child.stderr.take().ok_or_else(missing)?;

        let (batches, to_write) = mpsc::channel::<Vec<u8>>();
        std::thread::spawn(move || write_batches(stdin, to_write));

        let (line_tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let failed = line.is_err();
                if line_tx.send(line).is_err() || failed {
                    break;
                }
            }
        });

        let stderr = Arc::new(Mutex::new(Tail::default()));
        let tail = Arc::clone(&stderr);
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = stderr_pipe.read(&mut buf) {
                if n == 0 {
                    break;
                }
                if let Ok(mut t) = tail.lock() {
                    t.push(&buf[..n]);
                }
            }
            if let Ok(mut t) = tail.lock() {
                t.closed = true;
            }
        });
        Ok(Self {
            child,
            batches: Some(batches),
            lines,
            stderr,
        })
    }

    fn stderr_tail(&self) -> String {
        self.stderr
            .lock()
            .map(|t| {
                let bytes: Vec<u8> = t.bytes.iter().copied().collect();
                String::from_utf8_lossy(&bytes).into_owned()
            })
            .unwrap_or_default()
    }

    /// The stderr tail of a program that has exited: what it wrote last may still be in the
    /// pipe, so wait (up to [`EXIT_GRACE`]) for the reader to reach its end.
    fn final_stderr_tail(&self) -> String {
        let deadline = Instant::now() + EXIT_GRACE;
        while Instant::now() < deadline && !self.stderr.lock().map(|t| t.closed).unwrap_or(true) {
            std::thread::sleep(Duration::from_millis(5));
        }
        self.stderr_tail()
    }

    /// The program's exit status once it has exited (waiting up to [`EXIT_GRACE`]); it is
    /// killed if it has not.
    fn finish(&mut self) -> String {
        self.batches = None;
        let deadline = Instant::now() + EXIT_GRACE;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return status.to_string(),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                _ => {
                    let _ = self.child.kill();
                    return match self.child.wait() {
                        Ok(status) => format!("still running, killed: {status}"),
                        Err(e) => format!("status unknown: {e}"),
                    };
                }
            }
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.finish();
    }
}

/// Writes each batch to the program's stdin; stops when the program closes it (its exit is
/// then reported by the stdout side) or when tune drops the sender (closing stdin).
fn write_batches(mut stdin: ChildStdin, batches: Receiver<Vec<u8>>) {
    for batch in batches {
        if stdin
            .write_all(&batch)
            .and_then(|()| stdin.flush())
            .is_err()
        {
            break;
        }
    }
}

/// A reward computed by a program (see the module's doc).
pub struct CommandReward {
    name: String,
    argv: Vec<String>,
    timeout: Duration,
    /// `None` once it has failed (the run is over; nothing more is sent).
    running: Option<Running>,
}

impl CommandReward {
    /// Starts `argv` (program and arguments) now, so a wrong path fails before the first
    /// rollout. Its rewards are logged as `rewards/<name>`, the name being the file name, without
    /// its extension, of the last argument that is not an option (`reward` for
    /// `[python3, reward.py]`). `timeout` bounds each batch, from its first line written to its last answer read.
    pub fn start(argv: Vec<String>, timeout: Duration) -> std::result::Result<Self, CommandError> {
        if argv.is_empty() {
            return Err(CommandError::Empty);
        }
        let running = Running::start(&argv).map_err(|source| CommandError::Spawn {
            command: display(&argv),
            source,
        })?;
        let script = argv.iter().rev().find(|a| !a.starts_with('-'));
        let name = script
            .and_then(|a| std::path::Path::new(a).file_stem())
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "command".into());
        Ok(Self {
            name,
            argv,
            timeout,
            running: Some(running),
        })
    }

    fn command(&self) -> String {
        display(&self.argv)
    }

    fn exchange(
        &self,
        running: &mut Running,
        batch: &[Completion<'_>],
    ) -> std::result::Result<Vec<Option<f64>>, CommandError> {
        let command = self.command();
        match running.lines.try_recv() {
            Ok(Ok(line)) => {
                return Err(CommandError::UnexpectedOutput {
                    command,
                    line,
                    stderr: running.stderr_tail(),
                });
            }
            Ok(Err(source)) => return Err(CommandError::Read { command, source }),
            Err(TryRecvError::Empty | TryRecvError::Disconnected) => {}
        }
        let rows: Vec<String> = batch.iter().map(json_line).collect();
        let mut bytes = Vec::with_capacity(rows.iter().map(|r| r.len() + 1).sum());
        for row in &rows {
            bytes.extend_from_slice(row.as_bytes());
            bytes.push(b'\n');
        }
        // A closed channel means the writer stopped because the program closed its stdin: the
        // missing answers below report it.
        if let Some(tx) = &running.batches {
            let _ = tx.send(bytes);
        }
        let deadline = Instant::now() + self.timeout;
        let mut rewards = Vec::with_capacity(batch.len());
        for (index, row) in rows.iter().enumerate() {
            let wait = deadline.saturating_duration_since(Instant::now());
            let row = || quote(row);
            match running.lines.recv_timeout(wait) {
                Ok(Ok(line)) => match parse_answer(&line) {
                    Some(r) => rewards.push(r),
                    None => {
                        return Err(CommandError::NotANumber {
                            command,
                            line,
                            index,
                            row: row(),
                            stderr: running.stderr_tail(),
                        });
                    }
                },
                Ok(Err(source)) => return Err(CommandError::Read { command, source }),
                Err(RecvTimeoutError::Timeout) => {
                    let _ = running.child.kill();
                    return Err(CommandError::Timeout {
                        command,
                        seconds: self.timeout.as_secs_f64(),
                        index,
                        row: row(),
                        stderr: running.stderr_tail(),
                    });
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let status = running.finish();
                    return Err(CommandError::Exited {
                        command,
                        status,
                        index,
                        row: row(),
                        stderr: running.final_stderr_tail(),
                    });
                }
            }
        }
        Ok(rewards)
    }
}

impl RewardFunction for CommandReward {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&mut self, batch: &[Completion<'_>]) -> Result<Scores> {
        let Some(mut running) = self.running.take() else {
            return Err(Box::new(CommandError::AlreadyFailed {
                command: self.command(),
            })
            .into());
        };
        match self.exchange(&mut running, batch) {
            Ok(rewards) => {
                self.running = Some(running);
                Ok(Scores {
                    rewards,
                    successes: None,
                })
            }
            // `running` drops here: the program is stopped.
            Err(e) => Err(Box::new(e).into()),
        }
    }
}

/// One completion's line: `prompt`, `completion`, then the row's other columns (columns named
/// `prompt` or `completion` are left out, as TRL leaves them out of a reward function's
/// keyword arguments: the two keys always mean the prompt and the completion).
fn json_line(c: &Completion<'_>) -> String {
    let mut obj = Map::new();
    obj.insert("prompt".into(), Value::String(c.prompt.to_string()));
    obj.insert("completion".into(), Value::String(c.completion.to_string()));
    for (k, v) in c.columns {
        if k != "prompt" && k != "completion" {
            obj.insert(k.clone(), v.clone());
        }
    }
    Value::Object(obj).to_string()
}

/// A finite JSON number, or `null`; `None` for anything else.
fn parse_answer(line: &str) -> Option<Option<f64>> {
    let t = line.trim();
    if t == "null" {
        return Some(None);
    }
    match serde_json::from_str::<Value>(t) {
        Ok(Value::Number(n)) => n.as_f64().filter(|v| v.is_finite()).map(Some),
        _ => None,
    }
}

fn quote(row: &str) -> String {
    match row.char_indices().nth(ROW_QUOTE) {
        Some((cut, _)) => format!("{}... ({} bytes)", &row[..cut], row.len()),
        None => row.to_string(),
    }
}

fn display(argv: &[String]) -> String {
    argv.iter()
        .map(|a| {
            if a.is_empty() || a.contains(char::is_whitespace) {
                format!("{a:?}")
            } else {
                a.clone()
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::super::RewardError;
    use super::*;
    use serde_json::json;
    use std::path::Path;

    /// A fresh directory for one test's scripts, removed when the test ends.
    fn dir(name: &str) -> tempfile::TempDir {
        tempfile::Builder::new()
            .prefix(&format!("tune-reward-{name}-"))
            .tempdir()
            .expect("temp dir")
    }

    fn script(dir: &Path, file: &str, text: &str) -> String {
        let path = dir.join(file);
        std::fs::write(&path, text).expect("script");
        path.display().to_string()
    }

    fn argv(parts: &[&str]) -> Vec<String> {
        parts.iter().map(|s| s.to_string()).collect()
    }

    fn completions<'a>(texts: &[&'a str], columns: &'a Map<String, Value>) -> Vec<Completion<'a>> {
        texts
            .iter()
            .map(|t| Completion {
                prompt: "What is 6 x 12?",
                completion: t,
                completion_tokens: 3,
                columns,
            })
            .collect()
    }

    fn command_error(r: Result<Scores>) -> CommandError {
        match r {
            Err(RewardError::Command(e)) => *e,
            other => panic!("expected a command error, got {other:?}"),
        }
    }

    const ECHO_PY: &str = r#"
import json, sys
seen = 0
for line in sys.stdin:
    row = json.loads(line)
    seen += 1
    if row["completion"] == "skip":
        print("null", flush=True)
    else:
        # the answer column arrives with the row; `seen` proves one process serves every batch
        print(float(row["completion"] == row["answer"]) + 10 * seen, flush=True)
"#;

    #[test]
    fn the_program_scores_every_batch_from_one_process_and_null_means_no_reward() {
        let d = dir("ok");
        let s = script(d.path(), "echo_reward.py", ECHO_PY);
        let mut r = CommandReward::start(argv(&["python3", &s]), DEFAULT_TIMEOUT).expect("start");
        assert_eq!(r.name(), "echo_reward");
        let cols = json!({"answer": "72", "prompt": "shadowed", "id": 7});
        let cols = cols.as_object().expect("object");
        let out = r
            .score(&completions(&["72", "71", "skip"], cols))
            .expect("first batch");
        assert_eq!(out.rewards, vec![Some(11.0), Some(20.0), None]);
        assert_eq!(out.successes, None);
        let out = r.score(&completions(&["72"], cols)).expect("second batch");
        assert_eq!(out.rewards, vec![Some(41.0)]);
    }

    #[test]
    fn each_line_holds_prompt_completion_and_the_rows_other_columns() {
        let cols = json!({"answer": "72", "prompt": "a column named prompt", "completion": 1});
        let cols = cols.as_object().expect("object");
        let c = Completion {
            prompt: "Q\nline two",
            completion: "A \"quoted\"",
            completion_tokens: 2,
            columns: cols,
        };
        let line = json_line(&c);
        assert!(!line.contains('\n'));
        let v: Value = serde_json::from_str(&line).expect("json");
        assert_eq!(
            v,
            json!({"prompt": "Q\nline two", "completion": "A \"quoted\"", "answer": "72"})
        );
    }

    #[test]
    fn a_program_that_exits_is_an_error_with_its_status_stderr_and_the_row() {
        let d = dir("crash");
        let s = script(
            d.path(),
            "crash.sh",
            "read line\necho 1\nread line\necho 'Traceback: boom' >&2\nexit 3\n",
        );
        let mut r = CommandReward::start(argv(&["sh", &s]), DEFAULT_TIMEOUT).expect("start");
        let cols = Map::new();
        let e = command_error(r.score(&completions(&["first", "second"], &cols)));
        let msg = e.to_string();
        match &e {
            CommandError::Exited {
                index,
                row,
                stderr,
                status,
                ..
            } => {
                assert_eq!(*index, 1);
                assert!(row.contains("\"second\""), "{row}");
                assert!(stderr.contains("Traceback: boom"), "{stderr}");
                assert!(status.contains('3'), "{status}");
            }
            other => panic!("{other}"),
        }
        assert!(msg.contains("crash.sh") && msg.contains("boom"), "{msg}");
        let again = command_error(r.score(&completions(&["x"], &cols)));
        assert!(
            matches!(again, CommandError::AlreadyFailed { .. }),
            "{again}"
        );
    }

    #[test]
    fn a_line_that_is_not_a_number_is_an_error_naming_the_line_and_row() {
        let d = dir("garbage");
        let s = script(
            d.path(),
            "garbage.sh",
            "read line\necho 0.5\nread line\necho 'reward: 1'\ncat > /dev/null\n",
        );
        let mut r = CommandReward::start(argv(&["sh", &s]), DEFAULT_TIMEOUT).expect("start");
        let cols = Map::new();
        let e = command_error(r.score(&completions(&["a", "b"], &cols)));
        match &e {
            CommandError::NotANumber {
                line, index, row, ..
            } => {
                assert_eq!(line, "reward: 1");
                assert_eq!(*index, 1);
                assert!(row.contains("\"b\""), "{row}");
            }
            other => panic!("{other}"),
        }
    }

    #[test]
    fn non_finite_numbers_are_not_rewards() {
        for bad in ["NaN", "nan", "Infinity", "1e999", "", "None", "true", "[1]"] {
            assert_eq!(parse_answer(bad), None, "{bad:?}");
        }
        assert_eq!(parse_answer(" -2.5e-1\r"), Some(Some(-0.25)));
        assert_eq!(parse_answer("3"), Some(Some(3.0)));
        assert_eq!(parse_answer("null"), Some(None));
    }

    #[test]
    fn a_program_that_does_not_answer_in_time_is_stopped_with_a_timeout_error() {
        let d = dir("timeout");
        let s = script(d.path(), "slow.sh", "read line\nexec sleep 30\n");
        let mut r =
            CommandReward::start(argv(&["sh", &s]), Duration::from_millis(300)).expect("start");
        let cols = Map::new();
        let t0 = Instant::now();
        let e = command_error(r.score(&completions(&["a"], &cols)));
        assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
        match &e {
            CommandError::Timeout {
                index,
                seconds,
                row,
                ..
            } => {
                assert_eq!(*index, 0);
                assert_eq!(*seconds, 0.3);
                assert!(row.contains("\"a\""), "{row}");
            }
            other => panic!("{other}"),
        }
    }

    #[test]
    fn a_program_that_answers_twice_is_caught_at_the_next_batch() {
        let d = dir("twice");
        let s = script(
            d.path(),
            "twice.sh",
            "while read line; do echo 1; echo 2; done\n",
        );
        let mut r = CommandReward::start(argv(&["sh", &s]), DEFAULT_TIMEOUT).expect("start");
        let cols = Map::new();
        assert_eq!(
            r.score(&completions(&["a"], &cols)).expect("batch").rewards,
            vec![Some(1.0)]
        );
        std::thread::sleep(Duration::from_millis(500));
        let e = command_error(r.score(&completions(&["b"], &cols)));
        assert!(
            matches!(&e, CommandError::UnexpectedOutput { line, .. } if line == "2"),
            "{e}"
        );
    }

    #[test]
    fn a_program_that_cannot_start_is_an_error_naming_it() {
        let e = CommandReward::start(argv(&["/nonexistent/reward-program"]), DEFAULT_TIMEOUT)
            .err()
            .expect("spawn fails");
        assert!(matches!(e, CommandError::Spawn { .. }));
        assert!(e.to_string().contains("/nonexistent/reward-program"));
        assert!(matches!(
            CommandReward::start(Vec::new(), DEFAULT_TIMEOUT),
            Err(CommandError::Empty)
        ));
    }
}
