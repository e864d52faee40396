"""Counts the peer ports: ``N of M hold`` (an xfail, known or new, counts as not holding)."""

_outcomes: dict[str, str] = {}


def pytest_runtest_logreport(report):
    nodeid = report.nodeid.replace("\\", "/")
    if "tests/peers/" not in nodeid:
        return
    if report.when == "call" or (report.when == "setup" and not report.passed):
        if hasattr(report, "wasxfail"):
            _outcomes[nodeid] = "xpass" if report.passed or report.failed else "xfail"
        else:
            _outcomes[nodeid] = report.outcome


def pytest_terminal_summary(terminalreporter):
    if not _outcomes:
        return
    for name in ("test_flex_ports", "test_fa_ports", "test_torch_nn", "test_torch_sdpa", None):
        sel = {k: o for k, o in _outcomes.items() if name is None or f"/{name}.py" in k}
        if not sel:
            continue
        held = sum(o == "passed" for o in sel.values())
        xf = sum(o == "xfail" for o in sel.values())
        label = "all peer ports" if name is None else name
        terminalreporter.write_line(f"peer parity, {label}: {held} of {len(sel)} hold "
                                    f"({xf} xfail, {len(sel) - held - xf} other)")
