"""docs/python.md's examples run as written: recording a torch loader and replaying it;
the adoption guide (an inference engine recording its load_weights, a Megatron trainer
serving its own tensors in place, synced twice and checked)."""
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

    def test_adoption_guide_runs(self):
        with open(DOC) as f:
            text = f.read()
        section = text.split("## Adopting ferry", 1)[1].split("\n## ", 1)[0]
        code = "\n".join(re.findall(r"```python\n(.*?)```", section, re.S))
        self.assertIn("ferry.record_load", code)
        self.assertIn("in_place=True", code)
        exec(compile(code, "docs/python.md (adopting ferry)", "exec"), {"__name__": "docs_guide"})


if __name__ == "__main__":
    unittest.main()
