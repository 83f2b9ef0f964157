//! `kvstream serve`: an OpenAI-compatible HTTP server on axum/tokio.
//!
//! Images ([`images`]): `image_url` content parts as data URLs or local file paths (never a
//! network fetch); the engine thread decodes and encodes them (arena loans), so malformed or
//! too-large images are 400s and the server keeps serving.
//!
//! One model, one sequence at a time ([`worker`]); requests wait in a bounded queue (429 when
//! full); a client that disconnects cancels its generation at the next token.

pub mod api;
pub mod images;
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
