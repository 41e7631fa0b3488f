"""`python -m ferry ARGS` (and the `ferry` console script of the pip package): runs the
ferry command. The pip package carries the binary in ferry/bin/ and the default model
configs in ferry/share/ferry/configs/, where the binary looks for them; in a build tree
(PYTHONPATH=build/python) the command is the one on PATH."""
import os
import shutil
import sys


def _binary():
    bundled = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "ferry")
    if os.access(bundled, os.X_OK):
        return bundled
    return shutil.which("ferry")


def main():
    exe = _binary()
    if exe is None:
        sys.stderr.write("ferry: the ferry command is not in this package (ferry/bin/ferry) nor on PATH\n")
        return 127
    os.execv(exe, [exe] + sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
