"""Imports vLLM once, then forks one engine process (``engine_driver.main``) per request.

Importing vLLM is about 11 of the 19 seconds a small engine process of these tests
lives on a 2-core machine, and the tests start dozens. Each engine still runs in a
process of its own, started fresh from a process that has only imported vLLM (no
engine, no OpenMP team yet): a fork, in a session of its own (the tests kill its
group on a timeout), with the test's environment, exactly as
``python engine_driver.py SPEC`` would run it. vLLM's global state never outlives
one engine, because it lives and dies in the fork.

Protocol, one JSON object per line: a request on stdin
``{"spec": "...", "env": {...}, "stdout": PATH, "stderr": PATH}``; on the reply
descriptor (this process's stdout, which its own output never uses) ``{"pid": N}``
once forked, then ``{"rc": N}`` when that process exited.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import traceback
from typing import Any, TextIO


def serve() -> None:
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever the imports print goes to stderr, never into the replies
    import engine_driver
    import torch  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401  the slow part, done once

    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            replies.close()
            _run_engine(engine_driver.main, request)
        _reply(replies, {"pid": pid})
        _, status = os.waitpid(pid, 0)
        _reply(replies, {"rc": os.waitstatus_to_exitcode(status)})


def _reply(replies: TextIO, message: dict[str, Any]) -> None:
    replies.write(json.dumps(message) + "\n")
    replies.flush()


def _run_engine(main: Any, request: dict[str, Any]) -> None:
    """In the fork: become ``python engine_driver.py SPEC`` with the request's environment."""
    code = 1
    try:
        os.setsid()
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(target, fd)
            os.close(target)
        sys.stdin.close()
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["engine_driver.py", request["spec"]]
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()  # what an interpreter exit would run (vLLM's and kvplug's cleanup)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


if __name__ == "__main__":
    serve()
