"""The front door: the README is a front page whose links lead somewhere, and the
reference tables the documentation site is built with (``serving.reference``) hold every
flag, TOML key and metric the code declares. (``make lint`` builds the site itself with
``mkdocs build --strict``: a broken link or API reference fails there.)"""

from __future__ import annotations

import argparse
import pathlib
import re

from serving import config, reference

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_readme_is_a_front_page_whose_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    for section in ("## Start here", "## Install as a package", "## Quick start: embed a model",
                    "## Quick start: serve", "## Quick start: generate", "## Measured",
                    "## Documentation", "## License"):  # fmt: skip
        assert section in text, section
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert links
    missing = [link for link in links if not (ROOT / link).is_file()]
    assert not missing, missing
    # every page of the site is reachable from the README's map or the site's nav
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in sorted((ROOT / "docs").rglob("*.md")):
        rel = page.relative_to(ROOT / "docs").as_posix()
        if rel.startswith("plans/"):
            continue
        assert rel in nav, f"docs/{rel} is in no navigation"


def test_no_document_points_outside_the_project():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        assert "../shared" not in page.read_text(), page


def test_the_configuration_reference_holds_every_flag_and_key():
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    flags = {s for a in parser._actions for s in a.option_strings if s not in ("-h", "--help")}
    listed = {f for row in reference.serve_flags() for f in row["flag"].strip("`").split(", ")}
    assert flags and flags <= listed, sorted(flags - listed)
    keys = set(reference.names(reference.toml_keys(), "key"))
    # (instance_group and dynamic_batching are Triton's spellings, shown beside the keys
    # they map onto)
    assert set(config.TOML_KEYS) - {"instance_group", "dynamic_batching"} == keys
    rows = {r["key"].strip("`"): r for r in reference.toml_keys()}
    assert rows["max_delay_us"]["Triton"] == "`dynamic_batching.max_queue_delay_microseconds`"
    assert rows["max_queue"]["takes"] == "an integer >= 1" and rows["max_queue"]["default"] == (
        "`4096`"
    )
    assert "[models.NAME]" in rows["slots"]["sections"]
    assert "[defaults]" not in rows["slots"]["sections"]
    table = reference.table(reference.serve_flags(), ["flag", "takes", "default", "what it does"])
    assert "| `--grpc-port` |" in table and table.count("\n") == len(reference.serve_flags()) + 2


def test_the_metrics_reference_is_what_the_collector_yields():
    rows = {r["metric"].strip("`"): r for r in reference.metric_families()}
    for name, kind, labels in [
        ("pxrt_requests_total", "counter", "`model`, `outcome`, `version`"),
        ("pxrt_request_duration_us", "histogram", "`model`, `version`"),
        ("pxrt_generations_total", "counter", "`model`, `reason`, `version`"),
        ("pxrt_slots_busy", "gauge", "`model`, `version`"),
        ("pxrt_cache_evictions_total", "counter", ""),
        ("pxrt_instance_batches_total", "counter", "`instance`, `model`, `version`"),
    ]:
        assert rows[name]["type"] == kind and rows[name]["labels"] == labels, rows[name]
    assert all(name.startswith("pxrt_") and row["help"] for name, row in rows.items())
