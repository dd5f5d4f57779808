//! Kubernetes names for the addresses in reports: services from kube-proxy's rules
//! ([`services`]).

pub mod services;
