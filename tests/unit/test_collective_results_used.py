"""Static check: the result of every collective helper that is out of place while compiling is used.

``tplayers.comm.all_reduce_sum`` reduces in place in eager mode but is the out-of-place custom op
``tplayers::all_reduce`` under ``torch.compile``; a caller that drops its return value is right
eagerly and silently wrong compiled (it was, for the domain norms' backward). Calls of these
helpers as bare statements are therefore forbidden in the library.
"""

import ast
import pathlib

import tplayers

OUT_OF_PLACE_WHEN_COMPILING = {"all_reduce_sum", "all_gather_along_dim", "halo_pad", "halo_adjoint"}


def _bare_calls(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            f = node.value.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in OUT_OF_PLACE_WHEN_COMPILING:
                yield name, node.lineno


def test_results_of_compile_out_of_place_collectives_are_used():
    root = pathlib.Path(tplayers.__file__).parent
    bad = [
        f"{path.relative_to(root)}:{line} {name}(...) result dropped"
        for path in sorted(root.rglob("*.py"))
        for name, line in _bare_calls(ast.parse(path.read_text()))
    ]
    assert not bad, "\n".join(bad)


def test_the_check_sees_a_dropped_result():
    tree = ast.parse("def f(x, g):\n    all_reduce_sum(x, g)\n    y = all_reduce_sum(x, g)\n    comm.halo_pad(x)\n")
    assert [(n, line) for n, line in _bare_calls(tree)] == [("all_reduce_sum", 2), ("halo_pad", 4)]
