"""The peak-RSS probe the benchmark scripts prepend to the code they run in fresh interpreters.

VmHWM is the peak RSS of this process image; ru_maxrss would carry over the parent's peak across
fork + exec, and the parents here have just built models or datasets."""

PEAK = """
def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
"""


class TreePeak:
    """The peak of the summed RSS of a process and its descendants, sampled every 0.2 s on a thread
    (vLLM's engine runs in processes of its own; VmHWM sees one process only)."""

    def __init__(self, pid: int):
        import threading

        self.pid, self.peak, self.done = pid, 0, threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        import psutil

        while not self.done.is_set():
            try:
                root = psutil.Process(self.pid)
                total = sum(p.memory_info().rss for p in [root, *root.children(recursive=True)] if p.is_running())
                self.peak = max(self.peak, total)
            except psutil.Error:
                pass
            self.done.wait(0.2)

    def stop(self) -> int:
        self.done.set()
        self.thread.join()
        return self.peak
