# syntax=docker/dockerfile:1
# Multi-stage image for cache-aware-router.
#
#   docker build -t cache-aware-router .
#   docker run --ulimit nofile=65535:65535 -p 6700:6700 \
#     -v $PWD/config.yaml:/workspace/configs/config.yaml:ro cache-aware-router
#
# Build args:
#   BUILDER_IMAGE   Rust toolchain image for the build stage
#   RUNTIME_IMAGE   base of the final image: needs glibc and nothing else (no shell, no
#                   package manager); the CA bundle is copied in from the builder
#   CARGO_REGISTRY  optional sparse-registry mirror for crates.io, e.g.
#                   sparse+https://mirror.example/index/ (empty = crates.io)
ARG BUILDER_IMAGE=rust:1.95-slim-bookworm
ARG RUNTIME_IMAGE=gcr.io/distroless/cc-debian12:nonroot

FROM ${BUILDER_IMAGE} AS builder
ARG CARGO_REGISTRY=""
WORKDIR /src
RUN if [ -n "$CARGO_REGISTRY" ]; then \
      mkdir -p "$CARGO_HOME" && printf '[source.crates-io]\nreplace-with = "mirror"\n[source.mirror]\nregistry = "%s"\n' "$CARGO_REGISTRY" >> "$CARGO_HOME/config.toml"; \
    fi
COPY Cargo.toml Cargo.lock ./
COPY src src
COPY benches benches
COPY bench bench
# The router only. TLS (https:// workers, Kubernetes API) is rustls with ring: no OpenSSL.
# Cache mounts keep the registry and build directory between builds (BuildKit).
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p cache-aware-router \
 && cp target/release/cache-aware-router /cache-aware-router

FROM ${RUNTIME_IMAGE}
COPY --from=builder /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY --from=builder /cache-aware-router /usr/local/bin/cache-aware-router
WORKDIR /workspace
# The binary itself refuses to start below this open-file limit, saying why (the
# runtime image has no shell for an entrypoint script).
ENV CACHE_AWARE_ROUTER_MIN_NOFILE=65535
USER 65532:65532
EXPOSE 6700
ENTRYPOINT ["/usr/local/bin/cache-aware-router"]
CMD ["-c", "/workspace/configs/config.yaml"]
