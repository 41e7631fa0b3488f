"""The runnable examples (examples/python/*.py: the README's Python examples) run to
completion against whichever ferry this interpreter imports (the build tree's through
PYTHONPATH under CTest; the installed package in CI's install step)."""
import glob
import os
import subprocess
import sys
import unittest

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "python")


class ExamplesTest(unittest.TestCase):
    def test_every_example_runs(self):
        scripts = sorted(glob.glob(os.path.join(EXAMPLES, "*.py")))
        self.assertGreaterEqual(len(scripts), 2, EXAMPLES)
        for script in scripts:
            with self.subTest(example=os.path.basename(script)):
                r = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120)
                self.assertEqual(r.returncode, 0, f"{script}\n{r.stdout}\n{r.stderr}")
                self.assertTrue(r.stdout.rstrip().endswith("\nok"), r.stdout)

    def test_version_is_the_project_version(self):
        import re

        import ferry
        with open(os.path.join(EXAMPLES, "..", "..", "CMakeLists.txt")) as f:
            version = re.search(r"project\(\s*ferry\s+VERSION\s+([0-9.]+)", f.read()).group(1)
        self.assertEqual(ferry.__version__, version)


if __name__ == "__main__":
    unittest.main()
