//! The pod watcher against a stand-in API server that serves recorded list and watch
//! responses (tests/k8s/): only this node's pods are asked for, list then watch events keep
//! the names right. No real API server runs on the project's machines.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Query, State};
use axum::response::IntoResponse;
use axum::routing::get;
use observer::k8s::pods::{PodNames, watch};

const LIST: &str = include_str!("k8s/pods-list.json");
const WATCH: &str = include_str!("k8s/pods-watch.jsonl");

type Seen = Arc<Mutex<Vec<std::collections::HashMap<String, String>>>>;

async fn pods(
    State(seen): State<Seen>,
    Query(q): Query<std::collections::HashMap<String, String>>,
) -> axum::response::Response {
    seen.lock().unwrap().push(q.clone());
    if q.get("watch").map(String::as_str) == Some("true") {
        // The recorded events, then the connection stays open as a real watch does.
        let events = futures_util::stream::iter(
            WATCH
                .lines()
                .map(|l| Ok::<_, std::convert::Infallible>(format!("{l}\n"))),
        );
        let idle = futures_util::stream::pending();
        let body = axum::body::Body::from_stream(futures_util::StreamExt::chain(events, idle));
        ([("content-type", "application/json")], body).into_response()
    } else {
        ([("content-type", "application/json")], LIST).into_response()
    }
}

#[tokio::test]
async fn this_nodes_pods_are_listed_then_watched() {
    let seen: Seen = Arc::default();
    let app = Router::new()
        .route("/api/v1/pods", get(pods))
        .with_state(seen.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let config = kube::Config::new(format!("http://{addr}").parse().unwrap());
    let client = kube::Client::try_from(config).unwrap();
    let names = Arc::new(PodNames::default());
    let n = names.clone();
    let task = tokio::spawn(async move { watch(client, "node-1", &n).await });

    let ip = |s: &str| s.parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while names.lookup(ip("172.17.0.7")).is_none() || names.lookup(ip("172.17.0.5")).is_some() {
        assert!(!task.is_finished(), "the watch ended: {:?}", task.await);
        assert!(Instant::now() < deadline, "names: {:?}", names.snapshot());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let coredns = names.lookup(ip("172.17.0.7")).unwrap();
    assert_eq!(
        (coredns.namespace.as_str(), coredns.name.as_str()),
        ("kube-system", "coredns-5d78c9869d-abcde")
    );
    // Deleted with both its addresses; a pending pod named once it has an IP; hostNetwork
    // pods do not name the node's address.
    assert!(names.lookup(ip("fd00::5")).is_none());
    assert_eq!(names.lookup(ip("172.17.0.9")).unwrap().name, "pending-0");
    assert!(names.lookup(ip("10.0.0.11")).is_none());
    assert_eq!(names.len(), 2, "{:?}", names.snapshot());
    // Every request asked for this node's pods only.
    let seen = seen.lock().unwrap().clone();
    assert!(seen.len() >= 2, "{seen:?}");
    for q in &seen {
        assert_eq!(
            q.get("fieldSelector").map(String::as_str),
            Some("spec.nodeName=node-1"),
            "{q:?}"
        );
    }
    assert!(
        seen.iter()
            .any(|q| q.get("watch").is_some_and(|w| w == "true"))
    );
    task.abort();
}
