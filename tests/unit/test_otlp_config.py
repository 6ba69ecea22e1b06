"""OTLP settings: precedence CLI > OTEL_EXPORTER_OTLP_* environment > config file > default."""

from __future__ import annotations

import json

import pytest
from llmobs import cli
from llmobs.errors import ExitCode
from llmobs.otlp.config import OtlpConfig, OtlpConfigError, load_file, parse_key_values, resolve


def test_defaults_without_any_layer():
    config = resolve({}, env={})
    assert config == OtlpConfig()
    assert config.resolved_endpoint() == "http://localhost:4317" and config.grpc_target() == "localhost:4317"
    assert not config.secure
    http = resolve({"protocol": "http/protobuf"}, env={})
    assert http.traces_url() == "http://localhost:4318/v1/traces"
    assert http.metrics_url() == "http://localhost:4318/v1/metrics"


def test_each_layer_overrides_the_one_below():
    file_values = {
        "endpoint": "http://file:4317",
        "timeout_s": 3,
        "service_name": "from-file",
        "batch_spans": 7,
    }
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://env:4317", "OTEL_EXPORTER_OTLP_TIMEOUT": "2500"}
    cli_values = {"endpoint": "http://cli:4317", "protocol": None}
    config = resolve(cli_values, env=env, file_values=file_values)
    assert config.endpoint == "http://cli:4317" and config.sources["endpoint"] == "cli"
    assert config.timeout_s == 2.5 and config.sources["timeout_s"] == "env:OTEL_EXPORTER_OTLP_TIMEOUT"  # ms
    assert config.service_name == "from-file" and config.sources["service_name"] == "file"
    assert config.batch_spans == 7
    assert config.protocol == "grpc" and "protocol" not in config.sources  # None on the CLI = not given
    # Without the CLI value the environment wins over the file.
    assert resolve({}, env=env, file_values=file_values).endpoint == "http://env:4317"


def test_signal_specific_variables_win_and_are_used_verbatim():
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://generic:4318",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://traces:4318/custom/path",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
    }
    config = resolve({}, env=env)
    assert config.traces_url() == "http://traces:4318/custom/path"  # no /v1/traces appended
    generic = resolve({}, env={k: v for k, v in env.items() if "TRACES" not in k})
    assert generic.traces_url() == "http://generic:4318/v1/traces"
    metrics = resolve({}, env={**env, "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://m:9/x"})
    assert metrics.metrics_url() == "http://m:9/x"


def test_headers_and_resource_attributes_are_parsed_and_url_decoded():
    env = {
        "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20abc, x-scope-orgid=tenant1",
        "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod,k8s.node.name=gpu-7",
    }
    config = resolve({}, env=env)
    assert config.headers == {"authorization": "Bearer abc", "x-scope-orgid": "tenant1"}
    assert config.resource_attributes["k8s.node.name"] == "gpu-7"
    assert resolve({"headers": {"a": "1"}}, env=env).headers == {"a": "1"}  # the CLI replaces, not merges
    with pytest.raises(OtlpConfigError, match="expected key=value"):
        parse_key_values("novalue", "header")


def test_tls_follows_the_scheme_unless_insecure_is_given():
    assert resolve({"endpoint": "https://collector:4317"}, env={}).secure
    assert not resolve({"endpoint": "https://collector:4317", "insecure": True}, env={}).secure
    assert not resolve(
        {}, env={"OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "https://c:1"}
    ).secure


@pytest.mark.parametrize(
    "values,env,message",
    [
        ({"protocol": "http/json"}, {}, "not one of"),
        ({}, {"OTEL_EXPORTER_OTLP_TIMEOUT": "soon"}, "OTEL_EXPORTER_OTLP_TIMEOUT"),
        ({}, {"OTEL_EXPORTER_OTLP_INSECURE": "maybe"}, "not a boolean"),
        ({"endpoint": "collector"}, {}, "needs a host and a port"),
        ({"protocol": "http/protobuf", "endpoint": "ftp://x:1"}, {}, "must start with http"),
        ({"certificate": "/nonexistent/ca.pem"}, {}, "no such file"),
        ({"client_key": __file__}, {}, "both a client key and a client certificate"),
        ({"backoff_initial_s": 5.0, "backoff_max_s": 1.0}, {}, "maximum backoff"),
    ],
)
def test_bad_settings_are_one_clear_error(values, env, message):
    with pytest.raises(OtlpConfigError, match=message) as info:
        resolve(values, env=env)
    assert info.value.exit_code == ExitCode.USAGE


def test_config_file_table(tmp_path):
    path = tmp_path / "llmobs.toml"
    path.write_text('[otlp]\nendpoint = "http://tempo:4317"\nheaders = { authorization = "Bearer x" }\n')
    assert resolve({}, env={}, file_values=load_file(path)).headers == {"authorization": "Bearer x"}
    path.write_text('[otlp]\nendpont = "typo"\n')
    with pytest.raises(OtlpConfigError, match="unknown \\[otlp\\] key 'endpont'"):
        resolve({}, env={}, file_values=load_file(path))
    path.write_text("[otlp\n")
    with pytest.raises(OtlpConfigError, match="not valid TOML"):
        load_file(path)


def test_cli_show_config_reports_sources_and_redacts_headers(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://env:4317")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "authorization=secret-token")
    code = cli.main(["otlp", "--protocol", "grpc", "--timeout", "4", "--show-config"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["config"]["endpoint"] == "http://env:4317" and out["sources"]["endpoint"].startswith("env:")
    assert out["config"]["timeout_s"] == 4.0 and out["sources"]["timeout_s"] == "cli"
    assert out["config"]["headers"] == {"authorization": "<redacted>"}
    assert "secret-token" not in json.dumps(out)


def test_cli_bad_env_value_is_one_line_with_usage_code(capsys, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "carrier-pigeon")
    assert cli.main(["otlp", "--show-config"]) == ExitCode.USAGE
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("error: protocol 'carrier-pigeon' is not one of") and err[1].startswith("hint:")


def test_cli_missing_store_is_an_error_and_creates_nothing(tmp_path, capsys):
    missing = tmp_path / "no" / "such.duckdb"
    code = cli.main(["otlp", "--db", str(missing), "--endpoint", "http://127.0.0.1:9"])
    assert code == ExitCode.STORE_ERROR
    assert capsys.readouterr().err.startswith(f"error: no store at {missing}")
    assert not missing.parent.exists()
