//! What every test binary needs of the router crate itself: starting a router in-process.
//! (Everything else is the `support` crate, which does not depend on the router.)

use std::path::Path;

use cache_aware_router::app::{self, RunningRouter};
use cache_aware_router::config::Config;
use tokio::net::TcpListener;

/// Starts a router in-process from YAML text (file name `test.yaml`) on 127.0.0.1:0.
pub async fn start_router(yaml: &str) -> RunningRouter {
    let config = Config::from_sources([(Path::new("test.yaml"), yaml)])
        .unwrap_or_else(|e| panic!("test config refused: {e}\n{yaml}"));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind router");
    app::spawn_on(config, listener, None).expect("spawn router")
}
