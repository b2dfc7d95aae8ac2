"""Operations on a data directory beside the data path: garbage collection, verification, format migration."""
