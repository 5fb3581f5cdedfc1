"""API keys: read strictly, presented as 'Bearer <key>' (any case of the scheme), and no keyless server on a
non-loopback address unless its config says so. (The live matrix over every route: test_front_door.)"""

from __future__ import annotations

import pytest

from deploy.auth import KeyCheck, is_loopback, read_api_key, require_key_or_consent
from deploy.errors import ApiError
from dspark.config import ConfigError
from dspark.schema import ServingSpec


def test_bearer_scheme_is_case_insensitive_and_a_bare_key_is_refused():
    keys = KeyCheck("s3cret")
    for good in ("Bearer s3cret", "bearer s3cret", "BEARER  s3cret ", " Bearer s3cret"):
        assert keys.accepts(good), good
    for bad in (None, "", "s3cret", "Bearer", "Bearer ", "Bearer s3cre", "Basic s3cret", "Bearer s3cret2",
                "Bearer \udcff"):
        assert not keys.accepts(bad), bad
    with pytest.raises(ApiError) as err:
        keys.check("s3cret")
    assert err.value.status == 401 and err.value.code == "invalid_api_key"
    assert KeyCheck(None).accepts(None) and not KeyCheck(None).enabled


def test_key_sources(tmp_path, monkeypatch):
    key_file = tmp_path / "key"
    key_file.write_text("  abc \n")
    assert read_api_key(ServingSpec(api_key_file=str(key_file))) == "abc"
    key_file.write_text("\n")
    with pytest.raises(ConfigError, match="serving.api_key_file.*empty"):
        read_api_key(ServingSpec(api_key_file=str(key_file)))  # an empty file never turns auth off silently
    with pytest.raises(ConfigError, match="does not exist"):
        read_api_key(ServingSpec(api_key_file=str(tmp_path / "missing")))
    monkeypatch.setenv("DSPARK_TEST_KEY", "from-env")
    assert read_api_key(ServingSpec(api_key_env="DSPARK_TEST_KEY")) == "from-env"
    monkeypatch.setenv("DSPARK_TEST_KEY", "   ")
    assert read_api_key(ServingSpec(api_key_env="DSPARK_TEST_KEY")) is None


def test_no_keyless_server_on_an_open_address_unless_told():
    closed = ServingSpec()
    for host in ("127.0.0.1", "localhost", "::1"):
        assert is_loopback(host)
        require_key_or_consent(closed, None, host)
    for host in ("0.0.0.0", "::", "10.0.0.5", None):
        with pytest.raises(ConfigError, match="allow_unauthenticated"):
            require_key_or_consent(closed, None, host)
        require_key_or_consent(closed, "key", host)
        require_key_or_consent(ServingSpec(allow_unauthenticated=True), None, host)
