//! Kubernetes names for the addresses in reports: services from kube-proxy's rules
//! ([`services`]) and this node's pods from the API server ([`pods`]).

pub mod pods;
pub mod services;
