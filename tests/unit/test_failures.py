"""The failure model: the class of an exception, of an exit code, and of a job from its nodes."""

from __future__ import annotations

import pytest

from core.failures import (
    ConfigError,
    DataError,
    ExitCode,
    FailureClass,
    Finding,
    InfraError,
    NanLossError,
    UserError,
    as_typed,
    classify,
    classify_exit_code,
    decide,
    exit_code_for,
)

pytestmark = pytest.mark.unit
INFRA, USER, DATA, OOM = FailureClass.INFRA, FailureClass.USER, FailureClass.DATA, FailureClass.OOM


def aws_error(status: int, code: str) -> Exception:
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "Op")


def mlflow_error(code: str, message: str) -> Exception:
    from mlflow.exceptions import MlflowException
    from mlflow.protos import databricks_pb2

    return MlflowException(message, error_code=getattr(databricks_pb2, code))


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (ConfigError("epocs"), USER),
        (DataError("gone"), DATA),
        (NanLossError("nan"), USER),
        (MemoryError(), OOM),
        (ConnectionRefusedError(), INFRA),
        (RuntimeError("[gloo] Timed out waiting 1800000ms for recv"), INFRA),
        (ValueError("shape mismatch"), USER),
        (OSError(28, "No space left on device"), INFRA),
        (OSError(122, "Disk quota exceeded"), INFRA),
        (RuntimeError('IO Error: Could not write file "/tmp/x.tmp": No space left on device'), INFRA),  # DuckDB's
        (FileNotFoundError(2, "No such file or directory"), USER),
        (aws_error(503, "SlowDown"), INFRA),
        (aws_error(500, "InternalError"), INFRA),
        (aws_error(400, "ThrottlingException"), INFRA),
        (aws_error(403, "AccessDenied"), USER),
        (aws_error(400, "UnrecognizedClientException"), USER),
        (mlflow_error("INTERNAL_ERROR", "API request to http://mlflow/api failed: Max retries exceeded"), INFRA),
        (mlflow_error("TEMPORARILY_UNAVAILABLE", "try later"), INFRA),
        (mlflow_error("RESOURCE_DOES_NOT_EXIST", "Registered Model with name=x not found"), USER),
    ],
)
def test_classify(exc, expected):
    assert classify(exc) is expected


def test_missing_credentials_are_a_setting_to_fix_not_a_retry():
    from botocore.exceptions import NoCredentialsError, NoRegionError

    assert classify(NoCredentialsError()) is USER and classify(NoRegionError()) is USER
    error = as_typed(NoCredentialsError(), "preflight: the batch backend")
    assert isinstance(error, UserError) and "preflight: the batch backend: NoCredentialsError" in str(error)


def test_a_cause_is_followed_only_when_the_error_says_nothing():
    try:
        try:
            raise ConnectionResetError("peer")
        except ConnectionResetError as inner:
            raise OSError("s3fs wrapped it") from inner
    except OSError as outer:
        assert classify(outer) is INFRA
    try:
        try:
            raise ConnectionResetError("peer")
        except ConnectionResetError:
            raise ValueError("a bug while handling it")  # noqa: B904 - implicit context on purpose
    except ValueError as err:
        assert classify(err) is USER


def test_exit_codes_round_trip():
    assert exit_code_for(NanLossError("nan")) is ExitCode.NAN_LOSS
    assert exit_code_for(InfraError("x")) is ExitCode.INFRA
    assert exit_code_for(ConnectionError()) is ExitCode.INFRA
    assert classify_exit_code(0) is None and classify_exit_code(76) is USER and classify_exit_code(-9) is INFRA
    assert classify_exit_code(137) is OOM and classify_exit_code(143) is INFRA and classify_exit_code(2) is USER


def test_the_one_precedence_rule():
    nan = Finding(USER, "rank 1: NaN loss")
    peer = Finding(INFRA, "rank 0: gloo timeout")
    lost = Finding(INFRA, "node 1: Host EC2 terminated", node_lost=True)
    assert decide([peer, nan]) == nan  # a class a node chose beats a peer's INFRA
    assert decide([nan, lost, peer]) == lost  # a node the platform saw go beats everything
    assert decide([peer]) == peer and decide([]) is None
