"""Continuous batching: `Scheduler.step()` composed of a request table, a cache manager, prefill
and decode managers and stop rules; `SchedulerThread` runs it on a daemon thread."""

from lmnb.runtime.output.stop import StopRules
from lmnb.runtime.scheduler.cache_manager import CacheManager, IntegrityError
from lmnb.runtime.scheduler.contracts import OutputSink, SchedulerConfig
from lmnb.runtime.scheduler.loop import SchedulerThread
from lmnb.runtime.scheduler.request_state import ReqState
from lmnb.runtime.scheduler.scheduler import Scheduler
