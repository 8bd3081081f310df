from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from openk3.scale.metrics_merge import counter, merged_families, render

TEXT = """# HELP openk3:num_requests_running running
# TYPE openk3:num_requests_running gauge
openk3:num_requests_running{model_name="tiny"} %d
# HELP openk3:prompt_tokens_total prompt tokens
# TYPE openk3:prompt_tokens_total counter
openk3:prompt_tokens_total{model_name="tiny"} %d
"""


def test_each_family_once_with_every_replicas_samples_labelled() -> None:
    out = render([*merged_families({"r1": TEXT % (1, 10), "r2": TEXT % (2, 20)}), counter("openk3:scale_retries", "retries", 3)]).decode()
    assert out.count("# TYPE openk3:num_requests_running gauge") == 1
    samples = {(s.name, s.labels.get("replica")): s.value for f in text_string_to_metric_families(out) for s in f.samples}
    assert samples[("openk3:num_requests_running", "r1")] == 1 and samples[("openk3:num_requests_running", "r2")] == 2
    assert samples[("openk3:prompt_tokens_total", "r2")] == 20
    assert samples[("openk3:scale_retries_total", None)] == 3
