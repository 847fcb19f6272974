"""A real PostgreSQL for tests: `$FUSIONLAB_TEST_POSTGRES_URL`, or a throw-away cluster started by
`.ci/postgres.sh` for the session. Import the fixtures into a test module to use them."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / ".ci" / "postgres.sh"
PG_BIN = Path(os.environ.get("PG_BIN", "/usr/lib/postgresql/15/bin"))


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """URL of a PostgreSQL server this session may create databases on."""
    given = os.environ.get("FUSIONLAB_TEST_POSTGRES_URL")
    if given:
        yield given
        return
    if not (PG_BIN / "initdb").exists():
        pytest.skip(f"no PostgreSQL server binaries in {PG_BIN} (set PG_BIN or install them)")
    # Not pytest's tmp_path: that is private to root, and the server runs as a non-root user.
    env = {**os.environ, "FUSIONLAB_PG_DIR": f"/tmp/fusionlab-pg-{uuid.uuid4().hex[:12]}"}
    started = subprocess.run(
        [str(SCRIPT), "start"], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    if started.returncode != 0:
        pytest.fail(f".ci/postgres.sh start failed: {started.stderr.strip()}")
    try:
        yield started.stdout.strip()
    finally:
        subprocess.run([str(SCRIPT), "stop"], env=env, timeout=60, check=False)


@pytest.fixture
def fresh_postgres_url(postgres_url: str) -> Iterator[str]:
    """A new, empty database on that server (no Optuna tables yet), dropped afterwards."""
    import sqlalchemy

    name = f"t_{uuid.uuid4().hex[:16]}"
    admin = sqlalchemy.create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(sqlalchemy.text(f'CREATE DATABASE "{name}"'))
    try:
        yield (
            sqlalchemy.engine.make_url(postgres_url)
            .set(database=name)
            .render_as_string(hide_password=False)
        )
    finally:
        with admin.connect() as connection:
            connection.execute(sqlalchemy.text(f'DROP DATABASE "{name}" WITH (FORCE)'))
        admin.dispose()
