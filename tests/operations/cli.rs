//! The binary's command line: `--version`, `--config-check`, error messages naming file,
//! key and value, and layered `-c` files.

use support::binary::*;
use support::config::TempFile;

use crate::BINARY;

const VALID: &str = "workers:\n  - url: http://127.0.0.1:8001\n  - url: http://[::1]:8002/\n";

#[test]
fn version_flag_prints_the_package_version() {
    let o = BINARY.run(&["--version"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("cache-aware-router") && out.contains(env!("CARGO_PKG_VERSION")),
        "{out}"
    );
}

#[test]
fn help_names_the_signals_the_environment_the_config_reference_and_exit_codes() {
    let o = BINARY.run(&["--help"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let help = stdout(&o);
    for words in [
        "SIGHUP",
        "Only `workers` may change live",
        "SIGTERM, SIGINT",
        "server.shutdown_grace_secs",
        "RUST_LOG",
        "Overrides log.level",
        "CACHE_AWARE_ROUTER_MIN_NOFILE",
        "CACHE_AWARE_ROUTER_THREADS",
        "SSL_CERT_FILE",
        "KUBECONFIG",
        "README.md, section \"Configuration\"",
        "config.example.yaml",
        "--config-check: 0 when the files are valid, 2",
    ] {
        assert!(help.contains(words), "--help lacks {words:?}:\n{help}");
    }
    // The README section it points at exists.
    let readme = include_str!("../../README.md");
    assert!(
        readme.contains("\n## Configuration\n"),
        "README has no Configuration section"
    );
}

#[test]
fn config_check_accepts_a_valid_file() {
    let f = TempFile::new("valid.yaml", VALID);
    let o = BINARY.config_check(&[&f.path]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(o.status.code(), Some(0));
}

/// `--config-check` on a base file plus `over`: fails, and the message names the file
/// that holds the error, the key and (when given) the bad value.
fn assert_refused(over: &str, key: &str, value: Option<&str>) {
    let base = TempFile::new("base.yaml", VALID);
    let f = TempFile::new("over.yaml", over);
    let o = BINARY.config_check(&[&base.path, &f.path]);
    let err = stderr(&o);
    assert!(!o.status.success(), "{over:?} should be refused");
    assert!(
        err.contains(&f.path.display().to_string()),
        "{over:?}: names the file: {err}"
    );
    assert!(err.contains(key), "{over:?}: names `{key}`: {err}");
    if let Some(v) = value {
        assert!(err.contains(v), "{over:?}: names the value `{v}`: {err}");
    }
}

#[test]
fn config_check_refuses_an_unknown_key() {
    assert_refused("cache:\n  treshold: 0.4\n", "treshold", None);
}

#[test]
fn config_check_refuses_a_threshold_above_one() {
    assert_refused("cache:\n  threshold: 1.5\n", "cache.threshold", Some("1.5"));
}

#[test]
fn config_check_refuses_max_load_zero() {
    assert_refused(
        "workers:\n  - url: http://127.0.0.1:8001\n    max_load: 0\n",
        "workers[0].max_load",
        Some("0"),
    );
}

#[test]
fn config_check_refuses_an_unbracketed_ipv6_worker_url() {
    assert_refused(
        "workers:\n  - url: \"http://::1:1\"\n",
        "workers[0].url",
        Some("http://::1:1"),
    );
}

#[test]
fn config_check_refuses_a_bad_otlp_endpoint_with_exit_2() {
    assert_refused(
        "tracing:\n  otlp_endpoint: \"collector:4318\"\n",
        "tracing.otlp_endpoint",
        Some("collector:4318"),
    );
    let base = TempFile::new("base.yaml", VALID);
    let f = TempFile::new("otlp.yaml", "tracing:\n  otlp_endpoint: \"ftp://c\"\n");
    assert_eq!(
        BINARY.config_check(&[&base.path, &f.path]).status.code(),
        Some(2)
    );
}

#[test]
fn empty_worker_list_is_refused_with_a_message_saying_so() {
    let f = TempFile::new("empty-workers.yaml", "workers: []\n");
    for extra in [&["--config-check"][..], &[][..]] {
        let path = f.path.display().to_string();
        let mut args = vec!["-c", path.as_str()];
        args.extend_from_slice(extra);
        let o = BINARY.run(&args);
        let err = stderr(&o);
        assert!(!o.status.success(), "{args:?} should fail");
        assert!(
            err.contains("worker list is empty") && err.contains(&path),
            "{args:?}: {err}"
        );
    }
}

/// The tokenizer is loaded by the part that tokenizes, and by startup before it
/// serves: a file it cannot use is refused like a config value, with exit 2, naming
/// the file, line and key, by `--config-check` and by a start alike.
#[test]
fn a_tokenizer_that_cannot_load_is_refused_before_serving() {
    let f = TempFile::new(
        "tokenizer.yaml",
        "server: {host: 127.0.0.1, port: 0}\nworkers:\n  - url: http://127.0.0.1:9\nprecise:\n  tokenizer: /nonexistent/model\n",
    );
    for extra in [&["--config-check"][..], &[][..]] {
        let path = f.path.display().to_string();
        let mut args = vec!["-c", path.as_str()];
        args.extend_from_slice(extra);
        let o = BINARY.run(&args);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.contains("invalid configuration")
                && err.contains(&format!("{path}:5: `precise.tokenizer`"))
                && err.contains("/nonexistent/model"),
            "{args:?}: {err}"
        );
    }
}

const BASE: &str = "policy: round_robin\nserver:\n  host: 127.0.0.1\n  port: 6999\nlog:\n  format: json\nworkers:\n  - url: http://127.0.0.1:9/\n";

#[test]
fn second_config_file_overrides_scalars_and_keeps_sibling_keys() {
    let base = TempFile::new("base.yaml", BASE);
    let over = TempFile::new("over.yaml", "policy: least_load\nserver:\n  port: 0\n");
    let r = BINARY.serve(&[&base.path, &over.path]);
    assert_eq!(
        r.addr.ip().to_string(),
        "127.0.0.1",
        "server.host kept from the first file"
    );
    assert_ne!(
        r.addr.port(),
        6999,
        "server.port overridden by the second file"
    );
    let w = workers_of(r.addr);
    assert_eq!(w["policy"], "least_load");
    assert_eq!(w["workers"][0]["url"], "http://127.0.0.1:9");
    assert_eq!(w["workers"].as_array().unwrap().len(), 1);
}

#[test]
fn empty_second_config_file_changes_nothing() {
    let base = TempFile::new("base.yaml", &BASE.replace("port: 6999", "port: 0"));
    let empty = TempFile::new("empty.yaml", "");
    let alone = BINARY.config_check(&[&base.path]);
    let layered = BINARY.config_check(&[&base.path, &empty.path]);
    assert!(layered.status.success(), "{}", stderr(&layered));
    assert_eq!(alone.stdout, layered.stdout);

    let r = BINARY.serve(&[&base.path, &empty.path]);
    assert_eq!(r.addr.ip().to_string(), "127.0.0.1");
    let w = workers_of(r.addr);
    assert_eq!(w["policy"], "round_robin");
    assert_eq!(w["workers"][0]["url"], "http://127.0.0.1:9");
}

#[test]
fn sighup_reloads_the_workers_and_counts_each_reload_in_metrics_by_result() {
    let base = BASE.replace("port: 6999", "port: 0");
    let f = TempFile::new("base.yaml", &base);
    let r = BINARY.serve(&[&f.path]);
    // The binary installs its SIGHUP handler before it binds, so a SIGHUP sent once it
    // serves is never the default action (exit); one that arrives before the reload
    // task listens waits for it.
    assert_eq!(workers_of(r.addr)["workers"].as_array().unwrap().len(), 1);
    let reloads = |result: &str| {
        let text = get_of(r.addr, "/metrics");
        support::observe::Scrape::parse(&text)
            .value("cache_aware_router_reloads_total", &[("result", result)])
    };

    std::fs::write(&f.path, format!("{base}  - url: http://127.0.0.1:10/\n")).unwrap();
    r.hang_up();
    eventually("the reload applied", || {
        workers_of(r.addr)["workers"].as_array().unwrap().len() == 2
    });
    // Counted right after the new list is in place (a scrape between the two sees 0).
    eventually("the applied reload counted", || reloads("applied") == 1.0);

    std::fs::write(
        &f.path,
        base.replace("round_robin", "least_load") + "cache:\n  threshold: 0.55\n",
    )
    .unwrap();
    r.hang_up();
    eventually("the rejected reload counted", || reloads("rejected") == 1.0);
    // Its log line names every key it changed, with both values.
    eventually("the rejection names its keys", || {
        r.output().lines().any(|l| {
            l.contains("reload rejected")
                && l.contains("policy: round_robin → least_load")
                && l.contains("cache.threshold: (unset) → 0.55")
        })
    });
    std::fs::write(&f.path, "workers: [\n").unwrap();
    r.hang_up();
    eventually("the invalid reload counted", || reloads("invalid") == 1.0);
    let w = workers_of(r.addr);
    assert_eq!(w["policy"], "round_robin");
    assert_eq!(w["workers"].as_array().unwrap().len(), 2);
    assert_eq!(reloads("applied"), 1.0);
}

#[test]
fn config_check_names_the_key_path_and_value_of_each_refusal() {
    for (over, key, value) in [
        ("workers: [{url: 70000}]\n", "workers[0].url", "70000"),
        ("server:\n  host: [a]\n", "server.host", "a list"),
        (
            "health:\n  endpoint: {x: 1}\n",
            "health.endpoint",
            "a mapping",
        ),
        ("log:\n  level: [debug]\n", "log.level", "a list"),
        ("log:\n  level: warning\n", "log.level", "warning"),
        (
            "health:\n  interval_secs: 0.0000001\n",
            "health.interval_secs",
            "0.0000001",
        ),
        ("proxy:\n  passthrough: open\n", "proxy.passthrough", "open"),
    ] {
        assert_refused(over, key, Some(value));
        let base = TempFile::new("base.yaml", VALID);
        let f = TempFile::new("over.yaml", over);
        let err = stderr(&BINARY.config_check(&[&base.path, &f.path]));
        assert!(
            !err.contains("f64") && !err.contains("expected a string at line"),
            "{over:?}: {err}"
        );
    }
}

#[test]
fn config_check_refuses_keys_that_cannot_be_a_header_without_printing_them() {
    for (key, v) in [
        ("workers[0].api_key", "\"sk-hidden-77\\n\""),
        ("workers[0].api_key", "\"\""),
        ("workers[0].api_key", "\"sk-\\u0001hidden-77\""),
        ("workers[0].api_key", "\"sk hidden-77\""),
    ] {
        let f = TempFile::new(
            "key.yaml",
            &format!("workers:\n  - url: http://127.0.0.1:8001\n    api_key: {v}\n"),
        );
        let o = BINARY.config_check(&[&f.path]);
        let all = stderr(&o) + &stdout(&o);
        assert!(!o.status.success(), "{v} accepted");
        assert!(all.contains(key), "{v}: {all}");
        assert!(!all.contains("hidden-77"), "{v}: the key is printed: {all}");
    }
    let f = TempFile::new(
        "key.yaml",
        "server:\n  admin_token: \"tok-hidden-77\\r\\n\"\nworkers:\n  - url: http://127.0.0.1:8001\n",
    );
    let o = BINARY.config_check(&[&f.path]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("server.admin_token") && !stderr(&o).contains("hidden-77"));
}

#[test]
fn check_answers_on_stdout_and_logs_go_to_stderr() {
    let f = TempFile::new("ok.yaml", VALID);
    let o = BINARY.config_check(&[&f.path]);
    assert!(o.status.success());
    assert!(stdout(&o).starts_with("configuration OK"), "{}", stdout(&o));
    assert_eq!(stderr(&o), "");
    let bad = TempFile::new("bad.yaml", "cache:\n  threshold: 2\n");
    let o = BINARY.config_check(&[&f.path, &bad.path]);
    assert_eq!(stdout(&o), "", "a refusal goes to stderr only");

    let f = TempFile::new("serve.yaml", &BASE.replace("port: 6999", "port: 0"));
    let r = BINARY.serve(&[&f.path]);
    get_of(r.addr, "/workers");
    let _ = get_raw(r.addr, "/v1/nothing-here");
    eventually("log lines written", || r.lines().len() >= 2);
    let lines = r.lines();
    assert!(
        lines.iter().all(|(s, _)| *s == Stream::Stderr),
        "every log line on stderr: {lines:?}"
    );
    assert!(
        lines.iter().all(|(_, l)| !l.contains('\u{1b}')),
        "no colour codes when stderr is not a terminal: {lines:?}"
    );
}

#[test]
fn a_url_password_never_appears_in_any_output() {
    const PW: &str = "pw-hunter2-secret";
    let bad = format!(
        "workers:\n  - url: http://127.0.0.1:9/\n  - url: http://admin:{PW}@127.0.0.1:10/\n"
    );
    // --config-check.
    let f = TempFile::new("pw.yaml", &bad);
    let o = BINARY.config_check(&[&f.path]);
    let all = stderr(&o) + &stdout(&o);
    assert!(!o.status.success());
    assert!(
        all.contains("workers[1].url") && all.contains("***@127.0.0.1:10"),
        "{all}"
    );
    assert!(!all.contains(PW), "{all}");

    // SIGHUP to a file with the password: the refusal is logged without it.
    let serving = BASE.replace("port: 6999", "port: 0\n  admin_token: tok-1");
    let f = TempFile::new("serve.yaml", &serving);
    let r = BINARY.serve(&[&f.path]);
    std::fs::write(
        &f.path,
        format!("{serving}  - url: http://u:{PW}@127.0.0.1:10/\n"),
    )
    .unwrap();
    r.hang_up();
    eventually("the refused reload logged", || {
        r.output().contains("reload failed")
    });
    // The admin API refuses such a worker, to add or to remove, without echoing it.
    let admin = |method: &str, target: &str, body: &str| {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(r.addr).unwrap();
        write!(
            s,
            "{method} {target} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer tok-1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut answer = String::new();
        s.read_to_string(&mut answer).unwrap();
        answer
    };
    let added = admin(
        "POST",
        "/workers",
        &format!(r#"{{"url":"http://u:{PW}@127.0.0.1:11"}}"#),
    );
    assert!(added.starts_with("HTTP/1.1 400"), "{added}");
    let removed = admin(
        "DELETE",
        &format!("/workers?url=http://u:{PW}@127.0.0.1:9"),
        "",
    );
    assert!(removed.starts_with("HTTP/1.1 400"), "{removed}");
    for (what, text) in [
        ("the log", r.output()),
        ("POST /workers", added),
        ("DELETE /workers", removed),
        ("/workers", get_of(r.addr, "/workers")),
        ("/metrics", get_of(r.addr, "/metrics")),
    ] {
        assert!(!text.contains(PW), "{what} shows the password: {text}");
    }
    assert!(r.output().contains("***@127.0.0.1:10"), "{}", r.output());
}

/// Starts the binary with a text-log config plus `extra`, its stderr written to a file,
/// until it says it listens; returns what it wrote.
fn text_log_of(extra: &str) -> String {
    let f = TempFile::new(
        "text.yaml",
        &format!(
            "server:\n  host: 127.0.0.1\n  port: 0\n{extra}workers:\n  - url: http://127.0.0.1:9/\n"
        ),
    );
    let log = TempFile::new("stderr.log", "");
    let file = std::fs::File::create(&log.path).unwrap();
    let mut child = BINARY
        .command()
        .arg("-c")
        .arg(&f.path)
        .stdout(std::process::Stdio::null())
        .stderr(file)
        .spawn()
        .unwrap();
    let mut text = String::new();
    eventually("the listening line in the log file", || {
        text = std::fs::read_to_string(&log.path).unwrap_or_default();
        text.contains("listening")
    });
    let _ = child.kill();
    let _ = child.wait();
    text
}

#[test]
fn a_log_written_to_a_file_has_no_escape_codes_unless_asked() {
    let plain = text_log_of("");
    assert!(!plain.contains('\x1b'), "{plain:?}");
    let never = text_log_of("log:\n  color: never\n");
    assert!(!never.contains('\x1b'), "{never:?}");
    let always = text_log_of("log:\n  color: always\n");
    assert!(always.contains("\x1b["), "{always:?}");
}

#[test]
fn plain_url_strings_are_worker_entries_and_mix_with_mappings() {
    let f = TempFile::new(
        "plain.yaml",
        "workers: [\"http://10.0.0.1:8000\", {url: \"http://10.0.0.2:8000\", max_load: 4}]\n",
    );
    let o = BINARY.config_check(&[&f.path]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stdout(&o).contains("2 worker(s)"), "{}", stdout(&o));
}

/// Every kind of refusal serde can produce (a wrong type for each kind of key, an
/// unknown name, a missing key, a section that is not a mapping), through the binary:
/// each names its key path and says what the key takes in the config's words, never a
/// Rust type.
#[test]
fn config_errors_name_the_key_and_speak_yaml_not_rust() {
    const RUST: &[&str] = &[
        "Raw",
        "struct",
        "enum",
        "Option<",
        "u8",
        "u16",
        "u32",
        "u64",
        "u128",
        "usize",
        "i64",
        "f64",
        "Duration",
        "PathBuf",
        "String",
        "::",
        "variant",
        "identifier",
        "unit value",
        "YAML tag",
        "map,",
        "sequence",
    ];
    // (a layer over a valid base, the key its error must name, words it must say)
    let cases: &[(&str, &str, &str)] = &[
        (
            "workers: [8000]",
            "`workers[0]`",
            "a URL string or a mapping with `url:`",
        ),
        (
            "workers: [[a]]",
            "`workers[0]`",
            "a URL string or a mapping with `url:`",
        ),
        (
            "workers: [~]",
            "`workers[0]`",
            "a URL string or a mapping with `url:`",
        ),
        ("workers: http://a:1", "`workers`", "is not a list"),
        (
            "workers: {url: http://a:1}",
            "`workers`",
            "a mapping is not a list",
        ),
        ("workers: [{name: x}]", "`workers[0]`", "missing key `url`"),
        (
            "workers: [{url: http://a:1, max_load: lots}]",
            "`workers[0].max_load`",
            "a whole number",
        ),
        (
            "workers: [{url: http://a:1, role: backup}]",
            "`workers[0].role`",
            "`primary` or `fallback`",
        ),
        (
            "workers: [{url: http://a:1, role: [a]}]",
            "`workers[0].role`",
            "`primary` or `fallback`",
        ),
        (
            "workers: [{url: http://a:1, bogus: 1}]",
            "`workers[0].bogus`",
            "unknown key",
        ),
        (
            "workers: [{url: http://a:1, kv_events: \"tcp://a:1\"}]",
            "`workers[0].kv_events`",
            "a mapping",
        ),
        (
            "workers: [{url: http://a:1, kv_events: {endpoint: \"tcp://a:1\", dp_size: two}}]",
            "`workers[0].kv_events.dp_size`",
            "a whole number",
        ),
        (
            "workers: [{url: http://a:1, lmcache: 5}]",
            "`workers[0].lmcache`",
            "a mapping",
        ),
        (
            "workers: [{url: http://a:1, cache_aware: maybe}]",
            "`workers[0].cache_aware`",
            "`true` or `false`",
        ),
        (
            "proxy: {queue: {timeout_ms: soon}}",
            "`proxy.queue.timeout_ms`",
            "a whole number",
        ),
        (
            "proxy: {queue: {timeout_ms: -5}}",
            "`proxy.queue.timeout_ms`",
            "a whole number",
        ),
        ("proxy: {queue: 5}", "`proxy.queue`", "a mapping"),
        (
            "proxy: {initial_backoff_ms: 1.5}",
            "`proxy.initial_backoff_ms`",
            "a whole number",
        ),
        (
            "proxy: {retryable_statuses: 502}",
            "`proxy.retryable_statuses`",
            "a list",
        ),
        (
            "proxy: {backoff_multiplier: fast}",
            "`proxy.backoff_multiplier`",
            "a number",
        ),
        (
            "proxy: {tls: {insecure_skip_verify: maybe}}",
            "`proxy.tls.insecure_skip_verify`",
            "`true` or `false`",
        ),
        ("log: {format: xml}", "`log.format`", "`text` or `json`"),
        ("log: {format: {a: 1}}", "`log.format`", "`text` or `json`"),
        (
            "log: {color: [a]}",
            "`log.color`",
            "one of: `auto`, `always`, `never`",
        ),
        ("log: 3", "`log`", "a mapping"),
        ("policy: fastest", "`policy`", "one of: `cache_aware`"),
        (
            "policy: {cache_aware: 1}",
            "`policy`",
            "one of: `cache_aware`",
        ),
        (
            "policy: !round_robin x",
            "`policy`",
            "one of: `cache_aware`",
        ),
        (
            "server: {port: http}",
            "`server.port`",
            "a whole number from 0 to 65535",
        ),
        ("server: {admin: 6701}", "`server.admin`", "a mapping"),
        (
            "server: {admin: {port: 99999}}",
            "`server.admin.port`",
            "a whole number from 0 to 65535",
        ),
        (
            "cache: {daily_cleanup_hour_utc: noon}",
            "`cache.daily_cleanup_hour_utc`",
            "a whole number",
        ),
        (
            "cache: {eviction_interval_secs: soon}",
            "`cache.eviction_interval_secs`",
            "a number of seconds",
        ),
        (
            "health: {failure_threshold: -1}",
            "`health.failure_threshold`",
            "a whole number",
        ),
        (
            "session: {mode: strict}",
            "`session.mode`",
            "`soft` or `hard`",
        ),
        (
            "session: {headers: x-session}",
            "`session.headers`",
            "a list",
        ),
        (
            "consistent_hash: {key: user}",
            "`consistent_hash.key`",
            "one of: `auto`, `session`, `digest`",
        ),
        (
            "precise: {chat_template_content_format: xml}",
            "`precise.chat_template_content_format`",
            "one of: `auto`, `string`, `openai`",
        ),
        (
            "precise: {tokenizer: [a]}",
            "`precise.tokenizer`",
            "a file path",
        ),
        (
            "response_cache: {semantic: {max_candidates: -1}}",
            "`response_cache.semantic.max_candidates`",
            "a whole number",
        ),
        (
            "response_cache: {endpoints: all}",
            "`response_cache.endpoints`",
            "a list",
        ),
        ("state: {namespace: [a]}", "`state.namespace`", "a string"),
        (
            "discovery: {dns: {name: x, port: http}}",
            "`discovery.dns.port`",
            "a whole number from 0 to 65535",
        ),
        (
            "discovery: {dns: {name: x}}",
            "`discovery.dns`",
            "missing key `port`",
        ),
        (
            "discovery: {dns: {name: x, port: 80, bogus: 1}}",
            "`discovery.dns.bogus`",
            "unknown key",
        ),
        (
            "discovery: {kubernetes: 5}",
            "`discovery.kubernetes`",
            "a mapping",
        ),
        (
            "engine_metrics: {interval_ms: fast}",
            "`engine_metrics.interval_ms`",
            "a whole number",
        ),
        ("workerz: []", "`workerz`", "unknown key"),
    ];
    let base = TempFile::new("base.yaml", VALID);
    let mut wrong = Vec::new();
    for (i, (over, key, words)) in cases.iter().enumerate() {
        let f = TempFile::new(&format!("bad-{i}.yaml"), &format!("{over}\n"));
        let o = BINARY.config_check(&[&base.path, &f.path]);
        let err = stderr(&o);
        let line = err.trim_end();
        let named = line.contains(&format!("{}:1: {key}: ", f.path.display()));
        let rust: Vec<&&str> = RUST.iter().filter(|r| line.contains(**r)).collect();
        if o.status.code() != Some(2)
            || !named
            || !line.contains(words)
            || !rust.is_empty()
            || line.contains('\n')
        {
            wrong.push(format!(
                "{over:?} → {line:?} (wanted {key} saying {words:?}; Rust words {rust:?})"
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of {}:\n{}",
        wrong.len(),
        cases.len(),
        wrong.join("\n")
    );
}
