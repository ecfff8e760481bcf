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
RUN pip install --no-cache-dir . && python manage.py collectstatic --noinput -v0
# /blobs exists (owned by app) so that a volume mounted there starts writable for app.
RUN useradd --create-home app && mkdir -p /app/var /blobs && chown app /app/var /blobs
USER app
EXPOSE 8000
CMD ["gunicorn", "config.wsgi", "--bind", "0.0.0.0:8000", "--workers", "3", "--threads", "4", \
     "--access-logfile", "-"]
