//! What a test's router is configured with: YAML listing mock workers, URLs that refuse
//! connections, and temporary files (layered configs, kubeconfigs, CA files).

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::worker::FakeWorker;

/// YAML: `extra` (top-level keys) followed by a `workers:` list of `urls`.
pub fn yaml_for_urls(urls: &[String], extra: &str) -> String {
    let mut y = String::from(extra);
    if !y.is_empty() && !y.ends_with('\n') {
        y.push('\n');
    }
    y.push_str("workers:\n");
    for u in urls {
        y.push_str(&format!("  - url: \"{u}\"\n"));
    }
    y
}

/// YAML: `extra` followed by the workers' URLs.
pub fn yaml_for(workers: &[&FakeWorker], extra: &str) -> String {
    let urls: Vec<String> = workers.iter().map(|w| w.url()).collect();
    yaml_for_urls(&urls, extra)
}

/// A URL whose port refuses connections (bound, then closed).
pub fn closed_port_url() -> String {
    let [url] = closed_port_urls::<1>();
    url
}

/// `N` distinct such URLs: every port is held until all are bound (ports bound and
/// closed one after the other can come back equal, and two workers with one URL are
/// one worker).
pub fn closed_port_urls<const N: usize>() -> [String; N] {
    let held: Vec<std::net::TcpListener> = (0..N)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("bind"))
        .collect();
    std::array::from_fn(|i| {
        format!(
            "http://127.0.0.1:{}",
            held[i].local_addr().expect("addr").port()
        )
    })
}

/// A temporary file removed on drop.
pub struct TempFile {
    pub path: PathBuf,
}

impl TempFile {
    pub fn new(name: &str, contents: &str) -> TempFile {
        static N: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "car-tests-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join(name);
        std::fs::write(&path, contents).expect("write temp file");
        TempFile { path }
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
        if let Some(dir) = self.path.parent() {
            let _ = std::fs::remove_dir(dir);
        }
    }
}
