//! Builds every running object from a [`Config`] and runs them: the listener, the
//! per-connection hyper service, SIGHUP reload and SIGTERM drain. The only place that
//! spawns long-lived tasks.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

mod parts;

pub use parts::Parts;

use crate::admin::Admin;
use crate::config::Config;
use crate::cores::Cores;
use crate::pools::pool::{Pool, health};
use crate::proxy::Router;
use crate::reload;
use crate::service::{self, Service};
use crate::shutdown::{self, Shutdown, Trigger};

/// A router serving on a bound listener, as started by [`spawn`].
pub struct RunningRouter {
    /// The address it listens on.
    pub addr: SocketAddr,
    /// The admin listener's address (`server.admin`), when one is configured.
    pub admin_addr: Option<SocketAddr>,
    /// The config it runs (SIGHUP's reload compares against it).
    config: Config,
    pool: Arc<Pool>,
    reloads: reload::ReloadMetrics,
    trigger: Trigger,
    task: JoinHandle<()>,
}

impl RunningRouter {
    /// Stops accepting, drains in-flight requests for up to `server.shutdown_grace_secs`,
    /// and waits for that to finish.
    pub async fn shutdown(self) {
        self.trigger.shutdown();
        let _ = self.task.await;
    }

    /// The config it was started with.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Its worker pool (what a reload changes).
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// A handle that triggers the same shutdown.
    pub fn trigger(&self) -> Trigger {
        self.trigger.clone()
    }
}

/// Serves `config` on an already bound `listener` (tests bind `127.0.0.1:0` first),
/// and on `server.admin` when set (bound here; `Err` when it cannot be). Client
/// connections run as tasks of the current runtime.
pub fn spawn(config: Config, listener: TcpListener) -> std::io::Result<RunningRouter> {
    spawn_on(config, listener, None)
}

/// As [`spawn`], with the main listener's connections placed on `cores` (thread per
/// core) when given; the admin listener's stay on the current runtime.
pub fn spawn_on(
    config: Config,
    listener: TcpListener,
    cores: Option<Arc<Cores>>,
) -> std::io::Result<RunningRouter> {
    let addr = listener.local_addr()?;
    let admin = match &config.server.admin {
        None => None,
        Some(a) => {
            let bind = format!("{}:{}", a.host, a.port);
            let std = std::net::TcpListener::bind(&bind).map_err(|e| {
                std::io::Error::new(
                    e.kind(),
                    format!("cannot listen on {bind} (server.admin): {e}"),
                )
            })?;
            std.set_nonblocking(true)?;
            Some(TcpListener::from_std(std)?)
        }
    };
    let admin_addr = admin.as_ref().map(|l| l.local_addr()).transpose()?;
    let grace = config.server.shutdown_grace;
    let (trigger, shutdown) = shutdown::channel();
    let parts = Parts::build(&config, &shutdown);
    spawn_upkeep(&config, &parts, &shutdown);
    let service = Arc::new(Service {
        admin: Arc::new(Admin::new(
            &config,
            Arc::clone(&parts.pools),
            Arc::clone(&parts.metrics),
            parts.fleet.clone(),
            parts.cache.clone(),
            Arc::clone(&parts.flow),
        )),
        router: Arc::new(Router::new(
            config.clone(),
            Arc::clone(&parts.pools),
            parts.upstream.clone(),
            Arc::clone(&parts.requests),
            parts.cache.clone(),
            Arc::clone(&parts.flow),
            parts.export.clone(),
        )),
    });
    let admin_task = admin.map(|l| {
        tokio::spawn(serve(
            Arc::clone(&service),
            l,
            service::Listener::Admin,
            shutdown.clone(),
            grace,
            None,
        ))
    });
    let main = tokio::spawn(serve(
        Arc::clone(&service),
        listener,
        service::Listener::Main,
        shutdown,
        grace,
        cores,
    ));
    let export = parts.export.clone();
    let task = tokio::spawn(async move {
        let _ = main.await;
        if let Some(t) = admin_task {
            let _ = t.await;
        }
        // The spans of the drained requests: sent before the process exits. Blocking,
        // and each POST runs on this runtime: off its worker threads.
        if let Some(x) = export {
            let _ = tokio::task::spawn_blocking(move || x.shutdown()).await;
        }
    });
    Ok(RunningRouter {
        admin_addr,
        addr,
        config,
        pool: Arc::clone(parts.pools.workers()),
        reloads: parts.reloads,
        trigger,
        task,
    })
}

/// The long-lived tasks that keep the parts current, each watching `shutdown`: health
/// probes, idle upstream connections, engine signals, discovery, the fleet's channel and
/// the workers' model lists (each pool's policy's own upkeep starts with the pool,
/// [`Parts::build`]).
fn spawn_upkeep(config: &Config, parts: &Parts, shutdown: &Shutdown) {
    let pool = || Arc::clone(parts.pools.workers());
    tokio::spawn(health::run(
        pool(),
        config.health.clone(),
        parts.upstream.clone(),
        shutdown.clone(),
    ));
    // Idle keep-alive connections to workers closed after `proxy.pool_idle_timeout_secs`.
    tokio::spawn(crate::upstream::close_idle(
        pool(),
        config.proxy.pool_idle_timeout,
        shutdown.clone(),
    ));
    // What the engines say about themselves: load scrapes, LMCache signals.
    if config.engine_metrics.enabled {
        tokio::spawn(crate::signals::engine_metrics::run(
            pool(),
            config.engine_metrics.clone(),
            parts.upstream.clone(),
            shutdown.clone(),
        ));
    }
    tokio::spawn(crate::signals::lmcache::run(
        pool(),
        parts.upstream.clone(),
        shutdown.clone(),
    ));
    // Workers found at run time (`discovery:`), into the pool's membership path.
    match &config.discovery {
        crate::config::DiscoveryConfig::Static => {}
        crate::config::DiscoveryConfig::Dns(d) => {
            tokio::spawn(crate::discovery::dns::run(
                pool(),
                d.clone(),
                shutdown.clone(),
            ));
        }
        crate::config::DiscoveryConfig::Kubernetes(k) => {
            tokio::spawn(crate::discovery::kubernetes::run(
                pool(),
                k.clone(),
                shutdown.clone(),
            ));
        }
    }
    // Routing state shared with the other router replicas (`state.redis_url`).
    if let Some(fleet) = &parts.fleet {
        tokio::spawn(Arc::clone(fleet).run(shutdown.clone()));
    }
    // Memory a burst freed, back to the system.
    tokio::spawn(crate::allocator::run(pool(), shutdown.clone()));
    // What each worker serves: its GET /v1/models, on join and every refresh; a pool
    // made for a model seen for the first time starts its policy's upkeep then.
    tokio::spawn(crate::pools::refresh::run(
        Arc::clone(&parts.pools),
        config.models.refresh_every(config.health.interval),
        config.health.timeout,
        parts.upstream.clone(),
        shutdown.clone(),
    ));
}

/// The binary's main loop: bind, serve, reload on SIGHUP, drain on SIGTERM/SIGINT
/// (a second signal exits at once).
pub async fn run(config: Config, files: Vec<PathBuf>) -> std::io::Result<()> {
    // Signal handlers first: before them, SIGHUP or SIGTERM would end the process.
    let hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
    let mut terminate = shutdown::TerminateSignals::new()?;
    let bind = format!("{}:{}", config.server.host, config.server.port);
    let listener = listen(&bind)
        .await
        .map_err(|e| std::io::Error::new(e.kind(), format!("cannot listen on {bind}: {e}")))?;
    tracing::info!(
        addr = %listener.local_addr()?,
        workers = config.workers.len(),
        policy = config.policy.as_str(),
        "cache-aware-router listening"
    );
    let threads = Cores::wanted().map_err(std::io::Error::other)?;
    let cores = if threads == 0 {
        None
    } else {
        Some(Arc::new(Cores::start(threads)?))
    };
    let running = spawn_on(config, listener, cores.clone())?;
    if let Some(admin) = running.admin_addr {
        tracing::info!(addr = %admin, "admin listener (/workers, /metrics, admin API) listening");
    }
    let reload_task = tokio::spawn(reload::run(
        running.config.clone(),
        Arc::clone(&running.pool),
        running.reloads.clone(),
        files,
        hup,
    ));
    terminate.recv().await;
    tracing::info!("shutting down: no new connections, draining in-flight requests");
    running.trigger().shutdown();
    tokio::select! {
        _ = running.task => tracing::info!("drained; bye"),
        _ = terminate.recv() => tracing::warn!("second signal: exiting now"),
    }
    reload_task.abort();
    if let Some(cores) = cores {
        // Drained (or a second signal): their threads end; joined off this runtime.
        let _ = tokio::task::spawn_blocking(move || cores.stop()).await;
    }
    Ok(())
}

/// Accept-queue length asked of the kernel (capped by `net.core.somaxconn`). tokio's
/// default of 128 makes a burst of hundreds of connects wait 1–2 s on SYN retries.
const LISTEN_BACKLOG: u32 = 4096;

/// Binds `addr` (host:port; `localhost` resolved) with [`LISTEN_BACKLOG`].
async fn listen(addr: &str) -> std::io::Result<TcpListener> {
    let addr = tokio::net::lookup_host(addr)
        .await?
        .next()
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, "no address"))?;
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

async fn serve(
    service: Arc<Service>,
    listener: TcpListener,
    on: service::Listener,
    mut shutdown: Shutdown,
    grace: Duration,
    cores: Option<Arc<Cores>>,
) {
    // The drain: each connection holds a receiver, told to finish its exchange and
    // close; the drain is over when every receiver is gone. (hyper-util's
    // `GracefulShutdown` does the same but cannot watch a connection that may upgrade.)
    let (drain, draining) = tokio::sync::watch::channel(false);
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => {
                    // Small SSE writes must leave at once, not wait for a delayed ACK.
                    let _ = stream.set_nodelay(true);
                    let service = Arc::clone(&service);
                    let watcher = draining.clone();
                    match &cores {
                        None => drop(tokio::spawn(serve_connection(service, stream, on, watcher))),
                        // Moved to the runtime it will live on: its socket is registered
                        // with that runtime's I/O driver, not this one's.
                        Some(cores) => match stream.into_std() {
                            Ok(stream) => cores.spawn(async move {
                                match TcpStream::from_std(stream) {
                                    Ok(stream) => serve_connection(service, stream, on, watcher).await,
                                    Err(e) => tracing::warn!(error = %e, "cannot take over a client connection"),
                                }
                            }),
                            Err(e) => tracing::warn!(error = %e, "cannot hand a client connection over"),
                        },
                    }
                }
                Err(e) => {
                    // e.g. EMFILE: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            _ = shutdown.wait() => break,
        }
    }
    drop(listener);
    drop(draining);
    drain.send_replace(true);
    tokio::select! {
        _ = drain.closed() => {}
        _ = tokio::time::sleep(grace) => {
            tracing::warn!(grace_secs = grace.as_secs_f64(), "grace period over; closing remaining connections");
        }
    }
}

/// Serves one client connection to its end (or to the drain, through `watcher`). A
/// WebSocket handshake upgrades it (`proxy::tunnel`): the connection's task ends there
/// and the tunnel's task carries the socket on.
async fn serve_connection(
    service: Arc<Service>,
    stream: TcpStream,
    on: service::Listener,
    mut watcher: tokio::sync::watch::Receiver<bool>,
) {
    let service = service_fn(move |req| {
        let service = Arc::clone(&service);
        async move { Ok::<_, Infallible>(service::handle(&service, req, on).await) }
    });
    let conn = http1::Builder::new()
        .timer(TokioTimer::new())
        // Copy each frame into the write buffer (one `write`) instead of queueing it for
        // `writev`: SSE events are small and the queue's bookkeeping cost more than the
        // copy (callgrind, a 23-event stream: 274.7k -> 270.3k instructions).
        .writev(false)
        .serve_connection(TokioIo::new(stream), service)
        .with_upgrades();
    tokio::pin!(conn);
    let drained = async {
        let _ = watcher.wait_for(|draining| *draining).await;
    };
    let ended = tokio::select! {
        ended = conn.as_mut() => ended,
        () = drained => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    drop(watcher);
    if let Err(e) = ended {
        tracing::debug!(error = %e, "client connection ended with an error");
    }
}
