"""Issue 14 item 3: tracking-URI credentials are redacted before anything is written (the end-to-end proof,
password written nowhere and an owner-only job folder, rides on tests/test_e2e_runs.py's single-rank run)."""
from __future__ import annotations

import pytest

from flodl_exp.tracking import redact_uri


@pytest.mark.parametrize("uri, want", [
    ("postgresql://user:pw@db:5432/ml", "postgresql://user:***@db:5432/ml"),
    ("http://u:p%40ss@h:5000/x?token=abc&a=1", "http://u:***@h:5000/x?token=***&a=1"),
    ("https://h/?password=x&Token=y&keep=z", "https://h/?password=***&Token=***&keep=z"),
    ("mysql+pymysql://root:secret@127.0.0.1/db", "mysql+pymysql://root:***@127.0.0.1/db"),
    ("sqlite:////a/b.db?password=s", "sqlite:////a/b.db?password=***"),
    ("https://user@h/", "https://user@h/"),
    ("sqlite:////a/b.db", "sqlite:////a/b.db"),
    ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
    ("databricks", "databricks"),
    ("", ""),
])
def test_redact_uri(uri, want):
    assert redact_uri(uri) == want
    assert redact_uri(want) == want


def test_the_live_uri_comes_from_the_environment(monkeypatch):
    from flodl_exp.tracking import URI_ENV, live_uri

    full = "postgresql://user:pw@db:5432/ml"
    monkeypatch.setenv(URI_ENV, full)
    assert live_uri(redact_uri(full)) == full
    assert live_uri("postgresql://user:***@other/ml") == "postgresql://user:***@other/ml"
