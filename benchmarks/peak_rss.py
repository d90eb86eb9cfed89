"""The peak-RSS probe the benchmark scripts prepend to the code they run in fresh interpreters.

VmHWM is the peak RSS of this process image; ru_maxrss would carry over the parent's peak across
fork + exec, and the parents here have just built models or datasets."""

PEAK = """
def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
"""
