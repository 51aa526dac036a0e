// runtime/data/dataset_index.h: index.json of a dataset split, written and
// read back (the format is documented in dataset.h).
//
// Internal to runtime/data: DatasetWriter::finish() writes the index last,
// and TokenDataset::open() parses and validates it before mapping any shard,
// so a damaged index fails with one line naming the file and the field.
//
//   std::string text = index_json_text(index);            // what finish() writes
//   DatasetIndex ix = parse_index(text, "d/index.json");   // a Data error on a bad index
#pragma once

#include <cstdint>
#include <string>

#include "runtime/data/dataset.h"

namespace xirang {

// A shard checksum as index.json stores it and error messages print it: 16 hex digits.
std::string checksum_hex(uint64_t v);

// The text of index.json: two-space-indented JSON, fields in the documented order.
std::string index_json_text(const DatasetIndex& index);

// Parses and validates index.json; `path` names the file in error messages.
DatasetIndex parse_index(const std::string& text, const std::string& path);

}  // namespace xirang
