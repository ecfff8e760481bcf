# Two stages: the builder has the compilers and fills a virtualenv; the runtime stage copies
# that virtualenv and the code onto a slim image with neither compilers nor pip caches.

FROM python:3.13-slim AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
# For a dependency that has no wheel for this platform; the runtime image never has them.
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# The dependencies alone, from pyproject.toml and nothing else: this layer (the slow one) is
# rebuilt when pyproject.toml changes, not when the code does.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
       > requirements.txt \
    && pip install --no-cache-dir -r requirements.txt

FROM python:3.13-slim AS runtime
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH PYTHONPATH=/app
# The user first: its id does not change when the code does.
RUN useradd --create-home --uid 10001 app
COPY --from=builder /opt/venv /opt/venv
WORKDIR /app
COPY manage.py ./
COPY config config
COPY durability durability
COPY workers workers
COPY dashboard dashboard
COPY api api
COPY examples examples
COPY templates templates
# collectstatic needs settings, not a key or a database: a throwaway key and var dir keep the
# embedded default from writing a secret key or database file into the image; the collected
# files then go where the settings look for them at run time (DURABILITY_VAR_DIR=/app/var).
# /app/var (0700) and /blobs belong to app, so a volume mounted on /blobs starts writable.
RUN SECRET_KEY=build-only DURABILITY_VAR_DIR=/tmp/build-var \
       python manage.py collectstatic --noinput -v0 \
    && mkdir -p /app/var /blobs \
    && mv /tmp/build-var/static /app/var/static \
    && rm -rf /tmp/build-var \
    && chown -R app /app/var /blobs \
    && chmod 0700 /app/var
USER app
EXPOSE 8000
CMD ["gunicorn", "config.wsgi", "--bind", "0.0.0.0:8000", "--workers", "3", "--threads", "4", \
     "--access-logfile", "-"]
