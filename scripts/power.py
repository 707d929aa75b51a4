"""The card's power draw, SM clock and temperature, from nvidia-smi. At its power limit a
card lowers its clock, the more the warmer it is, so a kernel's energy and not its time
alone says what a change to it is worth in a step (docs/PERFORMANCE.md, "The card at its
power limit"). Used by bench.py (thermals) and kernels.py (--energy)."""

from __future__ import annotations

import datetime
import statistics
import subprocess
import tempfile
import time


def _bus_id() -> str:
    """nvidia-smi's name of CUDA device 0 (which CUDA_VISIBLE_DEVICES may have renumbered)."""
    import cupy as cp

    p = cp.cuda.runtime.getDeviceProperties(0)
    return f"{p['pciDomainID']:08x}:{p['pciBusID']:02x}:{p['pciDeviceID']:02x}.0"


def _nvidia_smi(fields: str) -> list[str]:
    """nvidia-smi's command line for a CSV of `fields` about CUDA device 0."""
    return ["nvidia-smi", "-i", _bus_id(), f"--query-gpu={fields}", "--format=csv,noheader,nounits"]


def thermals() -> dict | None:
    """The card's temperature (C), SM clock (MHz) and power limit (W) now; None where
    nvidia-smi cannot tell."""
    try:
        out = subprocess.run(
            _nvidia_smi("temperature.gpu,clocks.sm,power.limit"),
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
        temperature, clock, limit = (float(x) for x in out.strip().split(","))
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None
    return {"temperature_c": temperature, "sm_clock_mhz": clock, "power_limit_w": limit}


def read_samples(lines) -> list[tuple[float, float, float, float]]:
    """(time.time() instant, W, MHz, C) of each line of nvidia-smi's CSV (timestamp,
    power.draw, clocks.sm, temperature.gpu); a line cut short or unreadable is left out."""
    samples = []
    for line in lines:
        fields = [x.strip() for x in line.split(",")]
        if len(fields) != 4:
            continue
        try:  # nvidia-smi's timestamp is local time, as time.time() reads it
            at = datetime.datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            watts, mhz, celsius = (float(x) for x in fields[1:])
        except ValueError:
            continue
        samples.append((at, watts, mhz, celsius))
    return samples


class Sampler:
    """nvidia-smi sampling the card's power, clock and temperature every period_ms while
    the `with` block runs; `mean(t0, t1)` averages the samples taken between two
    time.time() instants. (power.draw is a mean over the second before each sample on
    recent cards: start a window a second or more into what it measures.)"""

    def __init__(self, period_ms: int = 20):
        self.period_ms = period_ms
        self.samples: list[tuple[float, float, float, float]] = []  # time, W, MHz, C

    def __enter__(self) -> Sampler:
        self.file = tempfile.TemporaryFile("w+")
        try:
            self.proc: subprocess.Popen | None = subprocess.Popen(
                [
                    *_nvidia_smi("timestamp,power.draw,clocks.sm,temperature.gpu"),
                    "-lms",
                    str(self.period_ms),
                ],
                stdout=self.file,
                stderr=subprocess.DEVNULL,
            )
        except OSError:  # no nvidia-smi: no samples, and mean() says so with None
            self.proc = None
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            time.sleep(5 * self.period_ms / 1e3)  # the last samples of the block in
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self.file.seek(0)
        self.samples = read_samples(self.file)
        self.file.close()

    def mean(self, t0: float, t1: float) -> dict | None:
        """Mean power (W), SM clock (MHz) and the last temperature (C) of the samples
        between t0 and t1; None if there are none."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if not inside:
            return None
        return {
            "watts": statistics.fmean(s[1] for s in inside),
            "sm_clock_mhz": statistics.fmean(s[2] for s in inside),
            "temperature_c": inside[-1][3],
        }
