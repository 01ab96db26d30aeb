"""The generic example of docs/plugin.md, run as the test file it is: a column-parallel then a
row-parallel layer on 2 and 4 gloo ranks, against a reference computed once by a fixture in the
pytest process."""

from tests.support.doc_examples import define_example

define_example("generic", globals())
