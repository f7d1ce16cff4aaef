"""taskloop.connections without a server: URL parsing, redaction, TLS opt-outs, broker settings."""

from __future__ import annotations

import logging
import ssl

import kombu
import pytest
import redis

from taskloop.base.config import Settings
from taskloop.base.errors import ConnectionConfigError, StoreAccessDenied, StoreUnavailable
from taskloop.celery_fixes import transport
from taskloop.connections import clients, errors
from taskloop.connections.broker import broker_settings
from taskloop.connections.sentinel import SentinelConnection
from taskloop.connections.urls import parse, redact
from taskloop.runtime.celery_app import make_app


def cfg(**kwargs: object) -> Settings:
    base: dict[str, object] = {"redis_url": "redis://127.0.0.1:1/0", "broker_url": "redis://127.0.0.1:1/0",
                               "tls_ca": "", "tls_cert": "", "tls_key": "", "tls_insecure": False,
                               "sentinel_master": ""}
    base.update(kwargs)
    return Settings(**base)  # type: ignore[arg-type]


# --- redaction ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("url", "expected"), [
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("redis://:s3cret@h:6379/0", "redis://:***@h:6379/0"),
    ("redis://alice:s3cret@h:6379/0", "redis://alice:***@h:6379/0"),
    ("rediss://alice:p%40ss@h/1", "rediss://alice:***@h/1"),
    ("redis://alice:p@ss@h/1", "redis://alice:***@h/1"),  # an unencoded @ in the password
    ("redis://s3cret@h/0", "redis://***@h/0"),  # a lone userinfo is masked too
    ("redis://h:6379/0?password=s3cret", "redis://h:6379/0?password=***"),
    ("redis://h/0?ssl_ca_certs=/etc/ca.pem&password=s3cret", "redis://h/0?ssl_ca_certs=/etc/ca.pem&password=***"),
    ("sentinel://u:s3cret@a:1,b:2/0?master=m&sentinel_password=t0p",
     "sentinel://u:***@a:1,b:2/0?master=m&sentinel_password=***"),
    ("sentinel://:s3cret@a:1/0;sentinel://:s3cret@b:2/0", "sentinel://:***@a:1/0;sentinel://:***@b:2/0"),
    ("redis+cluster://:s3cret@a:7000,b:7001", "redis+cluster://:***@a:7000,b:7001"),
    ("not a url", "not a url"),
])
def test_redact(url: str, expected: str) -> None:
    assert redact(url) == expected
    assert "s3cret" not in redact(url) and "t0p" not in redact(url)


def test_redact_is_reexported_by_the_store() -> None:
    from taskloop.store.redis_store import redact as store_redact

    assert store_redact is redact


def test_target_repr_and_str_hide_passwords() -> None:
    target = parse("redis://alice:s3cret@h:1/0?", cfg())
    assert "s3cret" not in repr(target) and "s3cret" not in str(target)


# --- parsing --------------------------------------------------------------------------------------

def test_plain_url_with_acl_user() -> None:
    t = parse("redis://alice:p%40ss@redis.internal:6380/2", cfg())
    assert (t.kind, t.hosts, t.db, t.username, t.password, t.tls) == (
        "redis", (("redis.internal", 6380),), 2, "alice", "p@ss", None)


def test_password_in_query_string() -> None:
    t = parse("redis://h/3?password=s3cret&username=bob", cfg())
    assert (t.username, t.password, t.db, t.hosts) == ("bob", "s3cret", 3, (("h", 6379),))
    assert parse("redis://:s3cret@h/0?password=s3cret", cfg()).password == "s3cret"
    with pytest.raises(ConnectionConfigError, match="two different passwords") as info:
        parse("redis://:one@h/0?password=two", cfg())
    assert "one" not in str(info.value) and "two" not in str(info.value).replace("two different", "")


def test_defaults_and_ipv6() -> None:
    assert parse("redis://", cfg()).hosts == (("127.0.0.1", 6379),)
    assert parse("redis://[::1]:7000/0", cfg()).hosts == (("::1", 7000),)
    assert parse("redis://h?db=4", cfg()).db == 4


@pytest.mark.parametrize(("url", "message"), [
    ("redis://h/0?ssl_ca_cert=/x", "unknown option"),
    ("redis://h/0?ssl_ca_certs=/x", "TLS options given for a plain-text URL"),
    ("redis://h/x", "not a number"),
    ("redis://h:99999/0", "out of range"),
    ("redis://a:1,b:2/0", "several hosts"),
    ("amqp://guest@h//", "unsupported scheme"),
    ("127.0.0.1:6379", "not a Redis URL"),
    ("redis+cluster://h:7000/1", "only database 0"),
    ("sentinel://h:26379/0", "does not name the Sentinel master"),
    ("redis://h/0?master=m", "Sentinel options in a URL that is not sentinel"),
    ("rediss://h/0?ssl_cert_reqs=maybe", "use required or none"),
    ("rediss://h/0?ssl_check_hostname=perhaps", "ssl_check_hostname"),
])
def test_bad_urls_say_why(url: str, message: str) -> None:
    with pytest.raises(ConnectionConfigError, match=message):
        parse(url, cfg())


def test_sentinel_url() -> None:
    t = parse("redis+sentinel://u:pw@s1:26379,s2,[::1]:26381/1?master=mymaster&sentinel_password=sp", cfg())
    assert t.kind == "sentinel" and t.master == "mymaster" and t.db == 1
    assert t.hosts == (("s1", 26379), ("s2", 26379), ("::1", 26381))
    assert (t.username, t.password, t.sentinel_password) == ("u", "pw", "sp")
    assert parse("sentinel://s1/0", cfg(sentinel_master="from-env")).master == "from-env"
    assert parse("sentinel://s1/0?master=url", cfg(sentinel_master="from-env")).master == "url"


def test_cluster_url() -> None:
    t = parse("redis+cluster://:pw@n1:7000,n2:7001", cfg())
    assert (t.kind, t.hosts, t.db, t.password) == ("cluster", (("n1", 7000), ("n2", 7001)), 0, "pw")
    assert parse("rediss+cluster://n1:7000", cfg()).tls is not None


# --- TLS ------------------------------------------------------------------------------------------

def test_rediss_is_verified_by_default() -> None:
    tls = parse("rediss://h/0", cfg()).tls
    assert tls is not None and tls.verify and tls.check_hostname and tls.ca_certs is None
    assert tls.redis_kwargs() == {"ssl_cert_reqs": "required", "ssl_check_hostname": True}


def test_tls_files_from_url_win_over_settings() -> None:
    settings = cfg(tls_ca="/env/ca.pem", tls_cert="/env/c.pem", tls_key="/env/c.key")
    tls = parse("rediss://h/0", settings).tls
    assert tls is not None and (tls.ca_certs, tls.certfile, tls.keyfile) == ("/env/ca.pem", "/env/c.pem", "/env/c.key")
    tls = parse("rediss://h/0?ssl_ca_certs=/url/ca.pem&ssl_certfile=/u/c&ssl_keyfile=/u/k", settings).tls
    assert tls is not None and (tls.ca_certs, tls.certfile, tls.keyfile) == ("/url/ca.pem", "/u/c", "/u/k")


def test_opt_outs() -> None:
    for url, settings in (("rediss://h/0?ssl_cert_reqs=none", cfg()), ("rediss://h/0?ssl_cert_reqs=CERT_NONE", cfg()),
                          ("rediss://h/0", cfg(tls_insecure=True))):
        tls = parse(url, settings).tls
        assert tls is not None and not tls.verify
        assert tls.redis_kwargs() == {"ssl_cert_reqs": "none", "ssl_check_hostname": False}
    # the URL's explicit choice wins over the environment's opt-out
    tls = parse("rediss://h/0?ssl_cert_reqs=required", cfg(tls_insecure=True)).tls
    assert tls is not None and tls.verify
    tls = parse("rediss://h/0?ssl_check_hostname=false", cfg()).tls
    assert tls is not None and tls.verify and not tls.check_hostname


def test_insecure_client_logs_a_warning_each_time(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="taskloop.connections")
    for _ in range(2):
        clients.store_client("rediss://:s3cret@127.0.0.1:1/0", config=cfg(tls_insecure=True)).close()
    warnings = [r for r in caplog.records if "verification is OFF" in r.getMessage()]
    assert len(warnings) == 2
    assert "TASKLOOP_TLS_INSECURE=1" in warnings[0].getMessage() and "s3cret" not in caplog.text
    caplog.clear()
    clients.store_client("rediss://127.0.0.1:1/0", config=cfg()).close()
    assert not caplog.records


def test_store_client_kinds() -> None:
    plain = clients.store_client("redis://bob:pw@127.0.0.1:1/3?", config=cfg())
    kwargs = plain.get_connection_kwargs()
    assert (kwargs["username"], kwargs["password"], kwargs["db"], kwargs["decode_responses"]) == ("bob", "pw", 3, True)
    assert plain.connection_pool.connection_class is redis.Connection
    plain.close()
    secure = clients.store_client("rediss://127.0.0.1:1/0?ssl_ca_certs=/ca.pem", config=cfg())
    assert secure.connection_pool.connection_class is redis.SSLConnection
    assert secure.get_connection_kwargs()["ssl_ca_certs"] == "/ca.pem"
    secure.close()
    managed = clients.store_client("sentinel://127.0.0.1:1/2?master=m&password=pw", single_connection=False,
                                   config=cfg())
    assert isinstance(managed.connection_pool, redis.sentinel.SentinelConnectionPool)
    assert managed.connection_pool.connection_class is SentinelConnection
    assert managed.connection_pool.service_name == "m"
    assert managed.get_connection_kwargs()["password"] == "pw"
    assert managed.get_connection_kwargs()["db"] == 2
    assert clients.client_timeout(managed) == 5.0
    managed.close()


# --- the broker -----------------------------------------------------------------------------------

def test_password_in_query_no_longer_crashes_kombu() -> None:
    url = "redis://127.0.0.1:1/0?password=s3cret"
    with pytest.raises(TypeError, match="multiple values for keyword argument 'password'"):
        kombu.Connection(url)  # what Celery did with this URL before
    out = broker_settings(url, cfg())
    assert out["broker_url"] == "redis://:s3cret@127.0.0.1:1/0"
    conn = kombu.Connection(out["broker_url"])
    assert conn.password == "s3cret" and "s3cret" not in conn.as_uri()


def test_broker_acl_user_and_special_characters() -> None:
    out = broker_settings("redis://al%40ce:p%2Fw%3A@h:6380/1", cfg())
    assert out["broker_url"] == "redis://al%40ce:p%2Fw%3A@h:6380/1"
    conn = kombu.Connection(out["broker_url"])
    assert (conn.userid, conn.password, conn.hostname, conn.port) == ("al@ce", "p/w:", "h", 6380)


def test_broker_tls_is_verified() -> None:
    out = broker_settings("rediss://h:6380/0?ssl_ca_certs=/ca.pem", cfg())
    assert out["broker_url"] == "rediss://h:6380/0"
    assert out["broker_use_ssl"] == {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_check_hostname": True,
                                     "ssl_ca_certs": "/ca.pem"}
    bare = broker_settings("rediss://h:6380/0", cfg())
    assert bare["broker_use_ssl"]["ssl_cert_reqs"] == ssl.CERT_REQUIRED


def test_broker_tls_opt_out_warns(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="taskloop.connections")
    out = broker_settings("rediss://h/0", cfg(tls_insecure=True))
    assert out["broker_use_ssl"] == {"ssl_cert_reqs": ssl.CERT_NONE, "ssl_check_hostname": False}
    assert "Celery broker" in caplog.text and "verification is OFF" in caplog.text


def test_broker_sentinel() -> None:
    out = broker_settings("sentinel://:pw@s1:26379,s2:26380/2?master=mymaster&sentinel_password=sp", cfg(),
                          {"visibility_timeout": 3600})
    assert out["broker_url"] == "sentinel://:pw@s1:26379/2;sentinel://:pw@s2:26380/2"
    assert out["broker_transport_options"] == {"visibility_timeout": 3600, "ack_emulation": False,
                                               "master_name": "mymaster", "sentinel_kwargs": {"password": "sp"}}
    conn = kombu.Connection(out["broker_url"], transport_options=out["broker_transport_options"])
    assert conn.transport_cls == "sentinel" and conn.alt == out["broker_url"].split(";")


def test_broker_refuses_a_cluster_and_passes_other_brokers() -> None:
    with pytest.raises(ConnectionConfigError, match="cannot be a Redis Cluster") as info:
        broker_settings("redis+cluster://:s3cret@h:7000", cfg())
    assert "s3cret" not in str(info.value)
    assert broker_settings("amqp://guest:guest@rabbit//", cfg())["broker_url"] == "amqp://guest:guest@rabbit//"


def test_make_app_uses_the_broker_settings() -> None:
    app = make_app(cfg(redis_url="rediss://h/0", broker_url="rediss://:pw@h:6390/0?ssl_ca_certs=/ca.pem"))
    assert app.conf.broker_url == "rediss://:pw@h:6390/0"
    assert app.conf.broker_use_ssl["ssl_cert_reqs"] == ssl.CERT_REQUIRED
    assert app.conf.broker_transport_options["visibility_timeout"] == 3600
    conn = app.connection_for_write()
    # kombu's Redis transport with taskloop's fixes (taskloop/celery_fixes/transport.py), over TLS
    assert conn.ssl["ssl_ca_certs"] == "/ca.pem" and conn.transport_cls == transport.TRANSPORT
    sentinel = make_app(cfg(broker_url="sentinel://s1:1,s2:2/0?master=m"))
    assert sentinel.conf.broker_transport_options["master_name"] == "m"
    assert sentinel.connection_for_write().transport_cls == transport.SENTINEL_TRANSPORT
    with pytest.raises(ConnectionConfigError):
        make_app(cfg(broker_url="redis+cluster://h:7000"))


@pytest.mark.parametrize(("broker", "store", "same"), [
    ("redis://h:6379/0", "redis://h/0", True),
    ("redis://:pw@h:6379/0", "redis://h:6379/0?password=pw", True),
    ("redis://h:6379/0", "redis://h:6379/1", False),
    ("rediss://h:6379/0", "redis://h:6379/0", False),
    ("redis://alice:pw@h/0", "redis://bob:pw@h/0", False),  # the outbox would write the queue as the store's user
    ("sentinel://h:26379/0?master=m", "sentinel://h:26379/0?master=m", False),
    ("redis://h:7000/0", "redis+cluster://h:7000", False),
    ("amqp://h//", "redis://h/0", False),
])
def test_same_redis(broker: str, store: str, same: bool) -> None:
    from taskloop.runtime import outbox

    assert outbox.same_redis(broker, store) is same


# --- describe -------------------------------------------------------------------------------------

URL = "redis://alice:s3cret@h:6379/0"


@pytest.mark.parametrize(("exc", "cls", "message"), [
    (redis.exceptions.AuthenticationError("WRONGPASS invalid username-password pair or user is disabled."),
     StoreAccessDenied, "refused taskloop's credentials"),
    (redis.exceptions.NoPermissionError("NOPERM this user has no permissions to run the 'hset' command"),
     StoreAccessDenied, "does not let ACL user 'alice'"),
    (redis.exceptions.ConnectionError("Error 111 connecting to h:6379. Connection refused."),
     StoreUnavailable, "cannot reach Redis at redis://alice:\\*\\*\\*@h:6379/0 .*check that redis-server is running"),
    (redis.exceptions.TimeoutError("Timeout reading from socket"), StoreUnavailable, "cannot reach Redis"),
    (redis.exceptions.ConnectionError("Error 1 connecting to h:6379. [SSL: CERTIFICATE_VERIFY_FAILED] ..."),
     StoreUnavailable, "cannot verify the TLS certificate"),
    (redis.exceptions.ReadOnlyError("You can't write against a read only replica."), StoreUnavailable,
     "read-only replica"),
    (redis.exceptions.ClusterDownError("CLUSTERDOWN The cluster is down"), StoreUnavailable, "Redis Cluster"),
])
def test_describe(exc: Exception, cls: type[Exception], message: str) -> None:
    error = errors.describe(exc, URL)
    assert type(error) is cls
    assert error.args[0].count("s3cret") == 0
    import re

    assert re.search(message, str(error)), str(error)


def test_describe_scrubs_a_password_echoed_by_the_exception() -> None:
    error = errors.describe(redis.exceptions.ConnectionError("bad auth s3cret"), URL)
    assert "s3cret" not in str(error)
