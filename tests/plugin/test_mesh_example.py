"""The FSDP2 + tensor-parallel example of docs/plugin.md, run as the test file it is (4 gloo ranks, mesh dp2 x tp2):
values, every gradient and the parameters after optimizer steps against one device in float64."""

from tests.doc_examples import define_example

define_example("fsdp2-tp", globals())
