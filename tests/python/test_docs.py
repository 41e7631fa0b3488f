"""docs/python.md's inference-engine example (record a torch loader, replay) runs as written."""
import os
import re
import unittest

DOC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "python.md")


class DocsTest(unittest.TestCase):
    def test_recording_example_runs(self):
        with open(DOC) as f:
            text = f.read()
        section = text.split("## Recording a loader", 1)[1]
        code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
        exec(compile(code, "docs/python.md", "exec"), {"__name__": "docs_example"})


if __name__ == "__main__":
    unittest.main()
