"""What the benchmark scripts share: machine sampling (:mod:`.machine`), timing and statistics
(:mod:`.timing`), scratch files and the page cache (:mod:`.files`), result files and logs
(:mod:`.results`), several ranks of one script (:mod:`.ranks`)."""
