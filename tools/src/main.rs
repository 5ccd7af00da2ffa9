//! `kvplan`: the demo serving trace (default), the conformance runner and the benchmarks.

use std::process::ExitCode;

use kvplan::KvPlanBackend;
use kvplan_tools::bench::extension::HostProbe;
use kvplan_tools::conformance::{Report, check_file};
use kvplan_tools::{BackendName, OnBackend, bench, demo, with_backend};

const USAGE: &str = "usage:
  kvplan [generate ...]                      SmolLM2 served with speculative decoding (default;
                                             `kvplan generate --help` for its flags)
  kvplan demo [--backend NAME] [--inject-corruption]
                                             synthetic speculative-decoding trace (default);
                                             with --inject-corruption, one live KV slot is
                                             corrupted mid-run and the canary must report it
  kvplan check FILE.jsonl [--backend NAME]   run conformance vectors
  kvplan fuzz --seed S --cases N --backend NAME [--op gather|plan|canary|slots|all]
                                             N random and edge cases per op against the
                                             reference; prints a conformance record that
                                             reproduces the first disagreement
  kvplan chart TABLE.csv OUT.png              draw a README bar chart (header: caption,series..)
  kvplan bench gather|plan|canary|canary-small|host|extension|cuda-client [--backend NAME] [--reps N]   time the anchor grids
backends: reference, flex, vulkan, vulkan-unfused, cuda, cuda-unfused";

/// Why the binary stopped: a usage mistake (usage is printed) or a failure while running.
enum Failure {
    Usage(String),
    Run(String),
}

impl From<String> for Failure {
    fn from(message: String) -> Self {
        Failure::Run(message)
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(code) => code,
        Err(Failure::Usage(message)) => {
            eprintln!("kvplan: {message}\n{USAGE}");
            ExitCode::from(2)
        }
        Err(Failure::Run(message)) => {
            eprintln!("kvplan: {message}");
            ExitCode::from(2)
        }
    }
}

/// `name` after a probe: a missing device is an error line, not a panic.
fn usable(name: BackendName) -> Result<BackendName, String> {
    demo::choose(Some(name)).map(|choice| choice.name)
}

fn run(args: &[String]) -> Result<ExitCode, Failure> {
    match args.first().map(String::as_str) {
        None => return Ok(kvplan_tools::generate::main(&[])?),
        Some("generate") if args.iter().any(|a| a == "-h" || a == "--help") => {
            println!("{}", kvplan_tools::generate::USAGE);
            return Ok(ExitCode::SUCCESS);
        }
        Some("generate") => return Ok(kvplan_tools::generate::main(&args[1..])?),
        _ => {}
    }
    let mut positional = Vec::new();
    let mut backend = None;
    let mut reps = 50usize;
    let mut inject_corruption = false;
    let mut fuzz = kvplan_tools::fuzz::Fuzz {
        ops: kvplan_tools::fuzz::Op::ALL.to_vec(),
        seed: 0,
        cases: 1000,
    };
    let mut rest = args.iter();
    while let Some(arg) = rest.next() {
        match arg.as_str() {
            "--backend" => {
                let name = rest
                    .next()
                    .ok_or(Failure::Usage("--backend needs a name".into()))?;
                backend = Some(name.parse::<BackendName>().map_err(Failure::Usage)?);
            }
            "--reps" => {
                reps = rest
                    .next()
                    .and_then(|n| n.parse().ok())
                    // The timings take a median of the reps.
                    .filter(|&n| n > 0)
                    .ok_or(Failure::Usage("--reps needs a positive number".into()))?;
            }
            "--inject-corruption" => inject_corruption = true,
            "--seed" | "--cases" => {
                let number = rest
                    .next()
                    .and_then(|n| n.parse::<u64>().ok())
                    .ok_or(Failure::Usage(format!("{arg} needs a number")))?;
                if arg == "--seed" {
                    fuzz.seed = number;
                } else {
                    fuzz.cases = number as usize;
                }
            }
            "--op" => {
                let name = rest
                    .next()
                    .ok_or(Failure::Usage("--op needs a name".into()))?;
                fuzz.ops = match name.as_str() {
                    "all" => kvplan_tools::fuzz::Op::ALL.to_vec(),
                    one => vec![one.parse().map_err(Failure::Usage)?],
                };
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(ExitCode::SUCCESS);
            }
            _ => positional.push(arg.as_str()),
        }
    }
    match positional.as_slice() {
        ["check", file] => Ok(check(
            file,
            usable(backend.unwrap_or(BackendName::Reference))?,
        )?),
        ["demo"] => Ok(demo::run(backend, inject_corruption)?),
        ["fuzz"] => {
            let backend = usable(backend.unwrap_or(BackendName::Reference))?;
            Ok(run_fuzz(fuzz, backend)?)
        }
        [probe, name] if *probe == demo::PROBE_SUBCOMMAND => {
            let name = name.parse::<BackendName>().map_err(Failure::Usage)?;
            match demo::probe_here(name) {
                Ok(()) => Ok(ExitCode::SUCCESS),
                Err(why) => {
                    eprintln!("{why}");
                    Ok(ExitCode::FAILURE)
                }
            }
        }
        ["bench", which] => {
            let backend = usable(backend.unwrap_or(BackendName::Reference))?;
            let which = which.to_string();
            println!("kvplan bench {which} on {backend}, {reps} reps");
            with_backend(backend, Bench { which, reps })??;
            Ok(ExitCode::SUCCESS)
        }
        ["chart", csv, png] => {
            let text = std::fs::read_to_string(csv)
                .map_err(|error| format!("cannot read {csv}: {error}"))?;
            let table =
                kvplan_tools::chart::parse(&text).map_err(|error| format!("{csv}: {error}"))?;
            kvplan_tools::chart::draw(&table, std::path::Path::new(png))?;
            println!("chart: {} rows -> {png}", table.rows.len());
            Ok(ExitCode::SUCCESS)
        }
        _ => Err(Failure::Usage(format!(
            "unexpected arguments {positional:?}"
        ))),
    }
}

fn check(file: &str, backend: BackendName) -> Result<ExitCode, String> {
    let text =
        std::fs::read_to_string(file).map_err(|error| format!("cannot read {file}: {error}"))?;
    let report = with_backend(backend, Check { text: &text })?;
    for (id, mismatch) in &report.failures {
        println!("FAIL {id} {mismatch}");
    }
    println!("{file} on {backend}: {}", report.summary());
    println!("{}", report.summary());
    Ok(if report.failures.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn run_fuzz(fuzz: kvplan_tools::fuzz::Fuzz, backend: BackendName) -> Result<ExitCode, String> {
    println!(
        "kvplan fuzz on {backend}: seed {}, {} cases per op",
        fuzz.seed, fuzz.cases
    );
    let reports = with_backend(backend, fuzz)?;
    let (mut cases, mut disagreements) = (0, 0);
    for report in &reports {
        println!(
            "{}: {} cases, {} disagreements",
            report.op, report.cases, report.disagreements
        );
        let outcomes: Vec<String> = report
            .outcomes
            .iter()
            .map(|(outcome, n)| format!("{outcome} {n}"))
            .collect();
        println!("  reference outcomes: {}", outcomes.join(", "));
        cases += report.cases;
        disagreements += report.disagreements;
        if let Some(finding) = &report.first {
            let reproduces = match finding.reproduces {
                Some(true) => "yes",
                Some(false) => {
                    "no (the disagreement needs what the record cannot say: see its \"fuzz\" field)"
                }
                None => "unknown (kvplan check panicked on it)",
            };
            println!(
                "first disagreement, case {} (shrunk): {}",
                finding.case, finding.why
            );
            println!("kvplan check --backend {backend} reproduces it: {reproduces}");
            println!("{}", finding.record);
        }
    }
    println!("{cases} cases, {disagreements} disagreements");
    Ok(if disagreements == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// `kvplan check`'s job: one conformance file on one backend.
struct Check<'a> {
    text: &'a str,
}

impl OnBackend for Check<'_> {
    type Output = Report;

    fn run<B: KvPlanBackend>(self, device: B::Device) -> Report {
        check_file::<B>(self.text, &device)
    }
}

/// `kvplan bench`'s job: one grid on one backend.
struct Bench {
    which: String,
    reps: usize,
}

impl OnBackend for Bench {
    type Output = Result<(), String>;

    fn run<B: KvPlanBackend + HostProbe>(self, device: B::Device) -> Self::Output {
        let reps = self.reps;
        match self.which.as_str() {
            "gather" => bench::gather::<B>(&device, reps),
            "plan" => bench::plan::<B>(&device, reps),
            "canary" => bench::canary::<B>(&device, reps, true),
            "canary-small" => bench::canary::<B>(&device, reps, false),
            "host" => bench::host::<B>(&device, reps),
            "extension" => bench::extension::run::<B>(&device, reps),
            #[cfg(feature = "cuda")]
            "cuda-client" => bench::cuda_client(reps),
            other => Err(format!(
                "unknown bench {other:?} (gather, plan, canary, canary-small, host, extension, cuda-client)"
            )),
        }
    }
}
