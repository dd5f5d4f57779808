//! The agent's HTTP endpoints (axum): metrics and health on `--metrics-addr`; the streaming
//! API (`/v1/traces`, `/v1/drops`, NDJSON) on the unix socket and, when asked, on TCP.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use bytes::Bytes;

use super::hub::{Hub, Request};
use super::metrics::{Format, Metrics};
use super::tier2::{ArmRequest, Arming};
use crate::k8s::Names;
use crate::pipeline::subscription::Subscription;

/// Metrics and health.
pub fn metrics_router(metrics: Arc<Metrics>) -> Router {
    Router::new()
        .route("/metrics", get(serve_metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(metrics)
}

/// OpenMetrics when the scraper's `Accept` asks for it (Prometheus does), the text format
/// 0.0.4 otherwise (`metrics::Format::negotiate`).
async fn serve_metrics(State(m): State<Arc<Metrics>>, headers: HeaderMap) -> Response {
    let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok());
    let format = Format::negotiate(accept);
    (
        [(header::CONTENT_TYPE, format.content_type())],
        m.encode(format),
    )
        .into_response()
}

async fn readyz(State(m): State<Arc<Metrics>>) -> Response {
    if m.health().ready {
        let mut text = String::from("ready\n");
        for d in m.degraded() {
            text.push_str(&format!("degraded: {d}\n"));
        }
        (StatusCode::OK, text).into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: the probes are not attached yet\n",
        )
            .into_response()
    }
}

/// The streaming API, the names the agent knows addresses by, and tier 2's arming.
pub fn api_router(hub: Arc<Hub>, names: Arc<Names>, arming: Arc<Arming>) -> Router {
    let names_route = Router::new()
        .route("/v1/names", get(serve_names))
        .with_state(names);
    let arm_route = Router::new()
        .route("/v1/arm", get(arm_status).post(arm))
        .with_state(arming);
    Router::new()
        .route("/v1/traces", get(traces))
        .route("/v1/drops", get(drops))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/v1/version", get(version))
        .route("/v1/ruleset", get(ruleset))
        .with_state(hub)
        .merge(names_route)
        .merge(arm_route)
}

fn json(status: StatusCode, v: &impl serde::Serialize) -> Response {
    let mut body = serde_json::to_string(v).unwrap_or_default();
    body.push('\n');
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// `GET /v1/arm`: whether the brackets are armed, why, for how long still, and the links
/// the agent holds.
async fn arm_status(State(a): State<Arc<Arming>>) -> Response {
    json(StatusCode::OK, &a.status())
}

/// `seconds` (1 to 600) and `filter` of an arm request.
pub fn parse_arm(q: &HashMap<String, String>) -> Result<ArmRequest, String> {
    let max = super::tier2::MAX_ARM.as_secs();
    let s = q
        .get("seconds")
        .ok_or_else(|| format!("give seconds=N (1 to {max}): how long to arm the brackets"))?;
    let secs: f64 = s
        .parse()
        .map_err(|_| format!("seconds `{s}` is not a number"))?;
    if !secs.is_finite() || !(1.0..=max as f64).contains(&secs) {
        return Err(format!("seconds `{s}` is out of range: give 1 to {max}"));
    }
    let filter = q.get("filter").filter(|f| !f.trim().is_empty()).cloned();
    if let Some(f) = &filter {
        crate::filter::compile(f, &|name| crate::kernel::netns::ifindex(name))
            .map_err(|e| format!("bad filter: {e}"))?;
    }
    Ok(ArmRequest {
        seconds: Duration::from_secs_f64(secs),
        filter,
    })
}

/// `POST /v1/arm?seconds=N[&filter=EXPR]`: per-table brackets for N seconds, the
/// traversals the filter keeps (every one without) captured into the flight recorder.
async fn arm(State(a): State<Arc<Arming>>, Query(q): Query<HashMap<String, String>>) -> Response {
    match parse_arm(&q) {
        Ok(r) => {
            let body = serde_json::json!({
                "arming": true,
                "seconds": r.seconds.as_secs_f64(),
                "filter": r.filter,
            });
            a.request(r);
            json(StatusCode::ACCEPTED, &body)
        }
        Err(e) => (StatusCode::BAD_REQUEST, e + "\n").into_response(),
    }
}

/// What the cluster plugin checks before it streams (`k8s::cluster::check`).
async fn version() -> Response {
    let body = serde_json::json!({
        "observer": env!("CARGO_PKG_VERSION"),
        "api": crate::k8s::cluster::API_VERSION,
        "ruleset": RULESET_FORMAT,
    });
    (
        [(header::CONTENT_TYPE, "application/json")],
        format!("{body}\n"),
    )
        .into_response()
}

/// The largest ruleset `GET /v1/ruleset` serves: a 20,000-service kube-proxy dump is
/// tens of MiB.
pub const MAX_RULESET_BYTES: usize = 128 << 20;

/// One read of the node's rules at a time: each runs `iptables-save` and friends.
static RULESET_READING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// `GET /v1/ruleset`: what the node's rule, set, route, address and bridge commands print,
/// read now (on a blocking thread, not the event loop), as `observer explain --live` reads
/// them: `{"format": 1, "observer": VERSION, "texts": {...}, "failures": [...]}`. The
/// cluster plugin simulates on it (`kubectl observer trace --predict`).
async fn ruleset() -> Response {
    use std::sync::atomic::Ordering;
    if RULESET_READING.swap(true, Ordering::AcqRel) {
        return (
            StatusCode::TOO_MANY_REQUESTS,
            "the node's rules are being read for another client; try again in a moment\n",
        )
            .into_response();
    }
    let read = tokio::task::spawn_blocking(observer_rules::LiveTexts::read).await;
    RULESET_READING.store(false, Ordering::Release);
    let Ok((texts, failures)) = read else {
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            "reading the node's rules failed (see the agent's log)\n",
        )
            .into_response();
    };
    if texts.len() > MAX_RULESET_BYTES {
        return (
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "the node's rules are {} bytes, more than the {MAX_RULESET_BYTES} this agent \
                 serves: run `observer explain --live` on the node\n",
                texts.len()
            ),
        )
            .into_response();
    }
    let failures: Vec<String> = failures.iter().map(ToString::to_string).collect();
    json(
        StatusCode::OK,
        &serde_json::json!({
            "format": RULESET_FORMAT,
            "observer": env!("CARGO_PKG_VERSION"),
            "texts": texts,
            "failures": failures,
        }),
    )
}

/// The version of `/v1/ruleset`'s body (`texts` is [`observer_rules::LiveTexts`]).
pub use crate::k8s::cluster::RULESET_FORMAT;

async fn serve_names(State(names): State<Arc<Names>>) -> Response {
    let mut body = names.to_json().to_string();
    body.push('\n');
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// A subscriber's request: its query ([`Subscription::from_query`]) with the filter compiled
/// for the namespace the agent is in.
pub fn parse_request(q: &HashMap<String, String>) -> Result<Request, String> {
    let wants = Subscription::from_query(q)?;
    // Interface names are those of the agent's namespace (the process is in it).
    let program = wants.program().map_err(|e| format!("bad filter: {e}"))?;
    Ok(Request { program, wants })
}

fn ndjson(body: Body) -> Response {
    ([(header::CONTENT_TYPE, "application/x-ndjson")], body).into_response()
}

async fn traces(State(hub): State<Arc<Hub>>, Query(q): Query<HashMap<String, String>>) -> Response {
    let req = match parse_request(&q) {
        Ok(r) => r,
        Err(e) => return (StatusCode::BAD_REQUEST, e + "\n").into_response(),
    };
    let Some(rx) = hub.subscribe(req) else {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "{} clients are streaming already (the most at once); try again when one ends\n",
                super::hub::MAX_SUBSCRIBERS
            ),
        )
            .into_response();
    };
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<Bytes, Infallible>(b), rx))
    });
    ndjson(Body::from_stream(stream))
}

async fn drops(State(hub): State<Arc<Hub>>, Query(q): Query<HashMap<String, String>>) -> Response {
    let req = match parse_request(&q) {
        Ok(r) => r,
        Err(e) => return (StatusCode::BAD_REQUEST, e + "\n").into_response(),
    };
    let lines = hub.drops(&req);
    let stream = futures_util::stream::iter(lines.into_iter().map(Ok::<Bytes, Infallible>));
    ndjson(Body::from_stream(stream))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::Output;

    fn q(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn arm_requests_are_bounded() {
        let r = parse_arm(&q(&[("seconds", "5"), ("filter", "udp port 53")])).unwrap();
        assert_eq!(r.seconds, Duration::from_secs(5));
        assert_eq!(r.filter.as_deref(), Some("udp port 53"));
        for (bad, says) in [
            (&[("seconds", "0")][..], "1 to 600"),
            (&[("seconds", "601")][..], "1 to 600"),
            (&[("seconds", "x")][..], "not a number"),
            (&[][..], "give seconds"),
            (
                &[("seconds", "5"), ("filter", "udp port")][..],
                "bad filter",
            ),
        ] {
            let e = parse_arm(&q(bad)).unwrap_err();
            assert!(e.contains(says), "{bad:?}: {e}");
        }
    }

    #[test]
    fn requests_are_read_and_bad_ones_say_why() {
        let r = parse_request(&q(&[
            ("filter", "udp port 53"),
            ("output", "line"),
            ("sample", "4"),
            ("count", "10"),
            ("timeout", "2.5"),
        ]))
        .unwrap();
        assert_eq!(r.wants.output, Output::Line);
        assert_eq!((r.program.sample, r.wants.count), (4, Some(10)));
        assert_eq!(r.wants.timeout, Some(Duration::from_millis(2500)));
        assert_ne!(r.program.enabled, 0);
        let defaults = parse_request(&q(&[])).unwrap();
        assert_eq!(
            (defaults.wants.output, defaults.wants.count),
            (Output::Json, None)
        );
        assert_eq!(defaults.program.enabled, 0);
        for (bad, says) in [
            (("output", "xml"), "json, tree or line"),
            (("filter", "udp port"), "bad filter"),
            (("count", "-1"), "whole number"),
            (("timeout", "inf"), "out of range"),
        ] {
            let e = parse_request(&q(&[bad])).unwrap_err();
            assert!(e.contains(says), "{bad:?}: {e}");
        }
    }
}
