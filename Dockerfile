# The `trainer` service of docker-compose.yml: cloudckpt + CPU PyTorch running
# examples/compose_trainer.py against MinIO.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# CPU-only PyTorch from its own index, in a layer of its own (the code changes more often).
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

# The lock file pins the same versions CI tested (docs/install.md): a rebuild months later
# resolves in seconds to the same set instead of whatever the registry holds that day.
COPY pyproject.toml README.md constraints.txt ./
COPY cloudckpt ./cloudckpt
RUN pip install -c constraints.txt .

COPY examples ./examples

RUN useradd --create-home --uid 10001 trainer \
    && mkdir -p /var/lib/cloudckpt \
    && chown trainer /var/lib/cloudckpt
USER trainer

CMD ["python", "examples/compose_trainer.py"]
