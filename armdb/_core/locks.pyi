# Typed as threading.Lock's type, whose interface it has (acquire, release, locked, the
# context manager), though it is not that type at run time: the annotations that say
# threading.Lock (BitcaskStore.lock_for, a Condition's lock) then accept it, and typeshed
# declares that type final.  The apply turnstile's methods (take_any, try_any, ticket,
# wait_turn, served, wait_drained; pending, draining) are called by armdb.tx on locks
# it holds as Any.
from _thread import LockType as Lock

__all__ = ["Lock"]
