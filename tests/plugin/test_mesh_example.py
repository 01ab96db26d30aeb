"""The mesh examples of docs/plugin.md, run as the test files they are (4 gloo ranks, mesh dp2 x tp2): the first
mesh test, and FSDP2 + tensor parallel with a vocab-parallel head against one device in float64 (values, every
gradient, the parameters after an optimizer step)."""

from tests.support.doc_examples import define_example

define_example("mesh", globals())
define_example("fsdp2-tp", globals())
