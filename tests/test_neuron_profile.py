"""Reading device time from a Neuron profile export, profiler arguments, compile-cache facts.

No public neuron-explorer export was found to test against, so tests/data/
neuron_system_profile_lnc2.json was MADE HERE to the documented system_profile.json schema
(Neuron Profiler 2.0 guide, "Generating JSON Output From Profiles": trace events with name,
timestamp and duration in ns, lnc_idx, instance_id, process_id), with three LNC=2 executions
whose two physical-core nc_exec_running intervals overlap. It is not a capture from hardware.
"""

from __future__ import annotations

import json
import shutil
import sys
import types
from pathlib import Path

import pytest

from fusionlab.devices import neuron_profile
from fusionlab.devices.neuron_profile import device_time_per_call

SAMPLE = Path(__file__).parent / "data" / "neuron_system_profile_lnc2.json"


def test_device_time_merges_lnc2_physical_cores_into_one_call(tmp_path):
    shutil.copy(SAMPLE, tmp_path / "system_profile.json")
    result = device_time_per_call(tmp_path, expected_calls=3)
    assert result.reason is None
    assert result.calls == pytest.approx([12e-6, 11e-6, 13e-6])
    assert result.per_call_s == pytest.approx(12e-6)


def test_device_time_is_unknown_not_zero_when_counts_disagree(tmp_path):
    shutil.copy(SAMPLE, tmp_path / "system_profile.json")
    result = device_time_per_call(tmp_path, expected_calls=4)
    assert result.per_call_s is None and "expected 4" in result.reason
    assert len(result.calls) == 3


def test_device_time_reads_the_trace_event_spelling_and_skips_zero_durations(tmp_path):
    events = json.loads(SAMPLE.read_text())["trace_events"]
    events.append({"name": "nc_exec_running", "timestamp": 1, "duration": 0, "lnc_idx": "1"})
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "system-trace.json").write_text(json.dumps({"trace_event": events}))
    assert device_time_per_call(tmp_path).per_call_s == pytest.approx(12e-6)


@pytest.mark.parametrize(
    ("files", "fragment"),
    [
        ({}, "no profile"),
        ({"p/ntrace.pb": b"\x08\x01", "p/profile_nc_0.ntff": b"\x00"}, "binary capture files"),
        ({"trace.json": b'{"traceEvents": []}'}, "no profile"),  # the framework trace only
        ({"system_profile.json": b'{"trace_events": [{"name": "nrt_execute", "duration": 5}]}'},
         "no timed nc_exec_running"),
    ],
    ids=["empty", "binary", "framework-only", "no-exec-events"],
)
def test_device_time_unknown_says_why(tmp_path, files, fragment):
    for name, data in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    result = device_time_per_call(tmp_path)
    assert result.per_call_s is None and fragment in result.reason
    if fragment in ("no profile", "binary capture files"):
        assert "neuron-explorer view -d" in result.reason  # tells the reader how to export


def test_profiler_kwargs_needs_torch_neuronx():
    if "torch_neuronx" in sys.modules or shutil.which("neuron-explorer"):
        pytest.skip("a Neuron SDK is installed here")
    with pytest.raises(RuntimeError, match="torch-neuronx"):
        neuron_profile.profiler_kwargs(None)


class _Recorder:
    """Stands in for torch_neuronx.profiling's documented constructors, recording the calls."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs

    def export_trace(self, prof):
        return prof


@pytest.mark.parametrize(("instruction_trace", "modes"), [(False, ["RUNTIME"]),
                                                          (True, ["DEVICE", "RUNTIME"])])
def test_profiler_kwargs_runtime_by_default_device_on_request(monkeypatch, tmp_path,
                                                              instruction_trace, modes):
    profiling = types.ModuleType("torch_neuronx.profiling")
    profiling.NeuronConfig = _Recorder
    profiling.NeuronProfiler = lambda config: _Recorder(config=config)
    profiling.ProfileMode = types.SimpleNamespace(DEVICE="DEVICE", RUNTIME="RUNTIME")
    package = types.ModuleType("torch_neuronx")
    package.profiling = profiling
    monkeypatch.setitem(sys.modules, "torch_neuronx", package)
    monkeypatch.setitem(sys.modules, "torch_neuronx.profiling", profiling)
    from torch.profiler import ProfilerActivity

    kwargs = neuron_profile.profiler_kwargs(str(tmp_path), instruction_trace=instruction_trace)
    assert set(kwargs) == {"activities", "experimental_config", "on_trace_ready"}
    assert kwargs["activities"] == [ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]
    assert kwargs["experimental_config"].kwargs == {"modes": modes,
                                                    "profile_output_dir": str(tmp_path)}
    assert kwargs.output_dir == str(tmp_path)
    temp = neuron_profile.profiler_kwargs(None)
    assert Path(temp.output_dir).is_dir() and temp.output_dir != str(tmp_path)


def test_cold_compile_timeout_covers_a_neuron_compile():
    assert neuron_profile.COLD_COMPILE_TIMEOUT_S >= 300


def test_export_command_is_the_documented_json_export(tmp_path):
    command = neuron_profile.export_command(tmp_path, tmp_path / "s.json")
    assert command[:2] == ["neuron-explorer", "view"]
    assert command[command.index("--output-format") + 1] == "json"
