FROM python:3.13-slim
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY config config
COPY durability durability
COPY workers workers
COPY dashboard dashboard
COPY examples examples
COPY templates templates
COPY manage.py ./
# collectstatic needs settings, not a key or a database: a throwaway key and var dir keep the
# embedded default from writing a secret key or database file into the image.
RUN pip install --no-cache-dir . \
    && SECRET_KEY=build-only DURABILITY_VAR_DIR=/tmp/build-var \
       python manage.py collectstatic --noinput -v0 \
    && rm -rf /tmp/build-var
# /blobs exists (owned by app) so that a volume mounted there starts writable for app.
RUN useradd --create-home app && mkdir -p /app/var /blobs && chown app /app/var /blobs \
    && chmod 0700 /app/var
USER app
EXPOSE 8000
CMD ["gunicorn", "config.wsgi", "--bind", "0.0.0.0:8000", "--workers", "3", "--threads", "4", \
     "--access-logfile", "-"]
