//! `kvstream serve`: an OpenAI-compatible HTTP server on axum/tokio.
//!
//! One model, one sequence at a time ([`worker`]); requests wait in a bounded queue (429 when
//! full); a client that disconnects cancels its generation at the next token.

pub mod api;
pub mod routes;
pub mod text_stream;
pub mod worker;

use anyhow::{Context, Result};

/// Serves `router` on `addr` until the process ends.
pub fn serve_blocking(state: routes::AppState, addr: &str) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        tracing::info!(%addr, "listening");
        eprintln!("kvstream serve: listening on http://{addr}");
        axum::serve(listener, routes::router(state))
            .await
            .context("server error")
    })
}
