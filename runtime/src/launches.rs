//! Counting the kernels this process launches on cubecl devices, from cubecl's own execution
//! log: at its profiling level `minimal` cubecl registers every launch by name (without timing
//! or synchronising), and here those records arrive through the `log` crate.
//!
//! cubecl reads its configuration once per process, so [`start`] must come before the first
//! use of a device; the counts then cover every kernel: burn's, cubek's and the runtime's own.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};

static ON: AtomicBool = AtomicBool::new(false);
static COUNT: AtomicU64 = AtomicU64::new(0);
static NAMES: Mutex<BTreeMap<String, u64>> = Mutex::new(BTreeMap::new());

/// cubecl's profiling records, received as `log` records.
struct Counter;

impl log::Log for Counter {
    fn enabled(&self, _: &log::Metadata) -> bool {
        true
    }
    fn log(&self, record: &log::Record) {
        let msg = record.args().to_string();
        if let Some(name) = msg.strip_prefix("Executing ") {
            // The kernel's name without its generic arguments.
            let name = name.split(['<', '\n']).next().unwrap_or(name).trim().to_string();
            *NAMES.lock().unwrap_or_else(|e| e.into_inner()).entry(name).or_insert(0) += 1;
            COUNT.fetch_add(1, Ordering::SeqCst);
        }
    }
    fn flush(&self) {}
}

static COUNTER: Counter = Counter;

/// Why counting could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cubecl's configuration was already read (a device was used before counting started): call launches::start first")]
    TooLate,
    #[error("another `log` logger is installed in this process")]
    Logger,
}

/// Turns launch counting on for this process.
pub fn start() -> Result<(), StartError> {
    if ON.load(Ordering::SeqCst) {
        return Ok(());
    }
    if CubeClRuntimeConfig::storage().lock().is_some() {
        return Err(StartError::TooLate);
    }
    log::set_logger(&COUNTER).map_err(|_| StartError::Logger)?;
    log::set_max_level(log::LevelFilter::Info);
    let config: CubeClRuntimeConfig = serde_json::from_value(serde_json::json!({
        "profiling": { "logger": { "level": "minimal", "log": "info" } }
    }))
    .expect("a valid cubecl configuration");
    CubeClRuntimeConfig::set(config);
    ON.store(true, Ordering::SeqCst);
    Ok(())
}

/// Kernels launched since [`start`], once cubecl's logger has caught up: the count is read
/// after it has not changed for 50 ms (the records travel through a channel to cubecl's logging
/// thread). Call it after the device has finished the work (a read, or a sync).
pub fn settled() -> u64 {
    let mut last = COUNT.load(Ordering::SeqCst);
    let mut since = Instant::now();
    let start = Instant::now();
    while since.elapsed() < Duration::from_millis(50) && start.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(5));
        let now = COUNT.load(Ordering::SeqCst);
        if now != last {
            last = now;
            since = Instant::now();
        }
    }
    last
}

/// Launches per kernel name since [`start`] (read after [`settled`]), most first.
pub fn by_name() -> Vec<(String, u64)> {
    let mut v: Vec<_> = NAMES.lock().unwrap_or_else(|e| e.into_inner()).iter().map(|(k, &n)| (k.clone(), n)).collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    v
}
