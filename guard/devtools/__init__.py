"""Tools for policy authors that run the engine: ``guard.devtools.explain`` (which rule fires for given answers, and
what each question scored) and ``guard.devtools.testing`` (a policy's table of test cases)."""
