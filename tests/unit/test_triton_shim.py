"""The library tritonserver runs with (supervisor/triton_shim.c), tried on a Python process: the token reaches main's
argv while the command line other users can read keeps the placeholder, and /dev/shm files stay 0600; tried on
``echo`` named tritonserver: Triton's HTTP, metrics and gRPC addresses become the fronts' Unix sockets."""

import os
import subprocess
import sys
import uuid

import pytest

from trident.supervisor import triton_shim

CHILD = """
import os, sys
print(sys.argv[1])
print(open("/proc/self/cmdline", "rb").read().split(b"\\0")[3].decode())
print(os.environ.get("TRIDENT_ACCESS_TOKEN", "(unset)"))
for path in sys.argv[2:]:
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    os.fchmod(fd, 0o644)  # as the python backend sets its regions
    print(oct(os.fstat(fd).st_mode & 0o777))
    os.close(fd)
    os.unlink(path)
"""


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    return triton_shim.build(tmp_path_factory.mktemp("shim"))


def _run(library, env_token, *args):
    env = {k: v for k, v in os.environ.items() if k != triton_shim.TOKEN_ENV}
    env["LD_PRELOAD"] = str(library)
    if env_token is not None:
        env[triton_shim.TOKEN_ENV] = env_token
    return subprocess.run([sys.executable, "-c", CHILD, *args], env=env, capture_output=True, text=True, timeout=60)


def test_the_token_reaches_main_and_never_the_command_line(library, tmp_path):
    shm, plain = f"/dev/shm/trident-test-{uuid.uuid4().hex}", tmp_path / "plain"
    arg = triton_shim.restriction(["model-repository", "logging"], "triton-access-token")
    done = _run(library, "s3cret-token", arg, shm, str(plain))
    assert done.returncode == 0, done.stderr
    argv, cmdline, environ, shm_mode, plain_mode = done.stdout.split()
    assert argv == "model-repository,logging:triton-access-token=s3cret-token"
    assert cmdline == arg == "model-repository,logging:triton-access-token=@TRIDENT_ACCESS_TOKEN@"
    assert environ == "(unset)"  # (not handed on to the stubs it starts)
    assert (shm_mode, plain_mode) == ("0o600", "0o644")  # only /dev/shm is kept private


def test_without_the_token_the_process_does_not_start(library):
    done = _run(library, None, triton_shim.restriction(["logging"], "h"))
    assert done.returncode == 78 and "TRIDENT_ACCESS_TOKEN is not set" in done.stderr
    assert done.stdout == ""


def _as_tritonserver(library, tmp_path, env_extra: dict, *args):
    """``echo`` run under the name ``tritonserver``: it prints the argv its main got."""
    program = tmp_path / "tritonserver"
    program.symlink_to("/bin/echo")
    env = {k: v for k, v in os.environ.items() if k not in triton_shim.SOCKET_ENVS.values()}
    env.update(LD_PRELOAD=str(library), **env_extra)
    return subprocess.run([str(program), *args], env=env, capture_output=True, text=True, timeout=60)


def test_triton_s_http_metrics_and_grpc_servers_move_to_the_fronts_sockets(library, tmp_path):
    envs = triton_shim.SOCKET_ENVS
    sockets = {envs["http"]: "/ws/sockets/http.sock", envs["metrics"]: "/ws/sockets/metrics.sock",
               envs["grpc"]: "/ws/sockets/grpc"}
    done = _as_tritonserver(library, tmp_path, sockets, "--http-address", "0.0.0.0", "--http-port", "8000",
                            "--metrics-address=0.0.0.0", "--grpc-address", "0.0.0.0", "--grpc-port=8001")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["--http-address", "unix:/ws/sockets/http.sock", "--http-port", "8000",
                                   "--metrics-address=unix:/ws/sockets/metrics.sock",
                                   "--grpc-address", "unix:/ws/sockets/grpc", "--grpc-port=8001"]
    # asked for with no address to replace: Triton would listen on the public port itself, so it does not start
    (tmp_path / "b").mkdir()
    missing = _as_tritonserver(library, tmp_path / "b", sockets, "--http-address", "0.0.0.0")
    assert missing.returncode == 78 and "no --metrics-address argument" in missing.stderr
    # not asked for: nothing changes
    (tmp_path / "c").mkdir()
    plain = _as_tritonserver(library, tmp_path / "c", {}, "--http-address", "0.0.0.0")
    assert plain.stdout.split() == ["--http-address", "0.0.0.0"]


MAKES_A_FOLDER = """
import ctypes, os, signal
libc = ctypes.CDLL(None)
libc.mkdtemp.restype = ctypes.c_char_p
print(libc.mkdtemp(ctypes.create_string_buffer(b"/tmp/python_env_XXXXXX")).decode(), flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # (killed, as a Triton killed with SIGKILL: it removes nothing)
"""


def test_a_killed_triton_s_python_backend_folder_is_removed_by_the_launcher(library, tmp_path):
    """The python backend's /tmp/python_env_* folder, which a killed Triton leaves: the shim lists it in the record,
    and remove_left_folders removes it; lines naming anything else remove nothing."""
    program, record = tmp_path / "tritonserver", tmp_path / "record"
    program.symlink_to(sys.executable)
    env = dict(os.environ, LD_PRELOAD=str(library), **{triton_shim.TEMP_RECORD_ENV: str(record)})
    done = subprocess.run([str(program), "-c", MAKES_A_FOLDER], env=env, capture_output=True, text=True, timeout=60)
    folder = done.stdout.strip()
    assert done.returncode == -9 and folder.startswith("/tmp/python_env_") and os.path.isdir(folder), done
    assert record.read_text() == folder + "\n"
    # lines naming what the python backend does not make: a folder outside /tmp, another name, a link
    (tmp_path / "python_env_mine").mkdir()
    other = f"/tmp/trident-test-{uuid.uuid4().hex}"
    os.mkdir(other)
    link = f"/tmp/python_env_link-{uuid.uuid4().hex}"
    os.symlink(tmp_path / "python_env_mine", link)
    try:
        record.write_text("\n".join([folder, str(tmp_path / "python_env_mine"), other, link, "/tmp/python_env_gone"]) + "\n")
        assert triton_shim.remove_left_folders(record) == 1
        assert not os.path.exists(folder) and not record.exists()
        assert (tmp_path / "python_env_mine").is_dir() and os.path.isdir(other) and os.path.islink(link)
        assert triton_shim.remove_left_folders(record) == 0  # (no record: nothing to do)
    finally:
        os.rmdir(other)
        os.unlink(link)
    # a process not named tritonserver lists nothing
    plain = subprocess.run([sys.executable, "-c", MAKES_A_FOLDER], env=env, capture_output=True, text=True, timeout=60)
    assert plain.returncode == -9 and not record.exists()
    os.rmdir(plain.stdout.strip())
